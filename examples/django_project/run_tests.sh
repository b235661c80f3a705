#!/usr/bin/env bash
# The example shop's tests, twice: on plain Celery, then with ojs_celery installed (SHOP_OJS=1).
# Both passes must pass unchanged (OJS-only tests are skipped in the plain pass). Needs Redis
# (SHOP_REDIS_URL, default OJS_TEST_REDIS_URL or redis://127.0.0.1:6379/0); extra arguments go
# to pytest. Usage: bash examples/django_project/run_tests.sh [-q] [-k ...]
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-../../.venv/bin/python}
export SHOP_REDIS_URL=${SHOP_REDIS_URL:-${OJS_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}}
status=0
for mode in 0 1; do
    run_dir=$(mktemp -d)
    echo "== example shop: $([ $mode = 1 ] && echo 'with ojs_celery' || echo 'plain Celery')" >&2
    SHOP_OJS=$mode SHOP_RUN_DIR=$run_dir SHOP_KEY_PREFIX="shop-$mode-$$-$RANDOM:" \
        "$PY" -m pytest "$@" || status=1
    rm -rf "$run_dir"
done
exit $status
