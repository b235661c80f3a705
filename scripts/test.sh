#!/usr/bin/env bash
# Set up a virtualenv with the test extras, lint, type-check and run the whole test suite.
# Tests that need Redis, RabbitMQ or PostgreSQL skip when the server is unreachable, unless
# OJS_TEST_REQUIRE_SERVICES=1 (as in CI), where they fail.
# The suite runs on three pytest-xdist workers, a module to each (its shared worker subprocess
# starts once): most of its time is spent waiting on real workers, heartbeats and timeouts,
# which overlap (three of them kept about a third of two cores busy). Extra arguments come
# last, so `-n 0` runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh "[test]"
.venv/bin/ruff check ojs_celery tests examples bench
.venv/bin/mypy
exec .venv/bin/pytest -n 3 --dist loadscope "$@"
