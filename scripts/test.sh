#!/usr/bin/env bash
# Set up a virtualenv with the test extras, lint, type-check and run the whole test suite.
# Tests that need Redis, RabbitMQ or PostgreSQL skip when the server is unreachable, unless
# OJS_TEST_REQUIRE_SERVICES=1 (as in CI), where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' >/dev/null
.venv/bin/ruff check ojs_celery tests examples bench
.venv/bin/mypy
exec .venv/bin/pytest "$@"
