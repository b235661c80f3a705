#!/usr/bin/env bash
# Set up a virtualenv with the test extras, lint, type-check and run the whole test suite.
# Tests that need Redis, RabbitMQ or PostgreSQL skip when the server is unreachable, unless
# OJS_TEST_REQUIRE_SERVICES=1 (as in CI), where they fail.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh "[test]"
.venv/bin/ruff check ojs_celery tests examples bench
.venv/bin/mypy
exec .venv/bin/pytest "$@"
