#!/usr/bin/env bash
# The example shop's tests, twice: on plain Celery, then with ojs_celery installed (SHOP_OJS=1).
# Both passes must pass unchanged (OJS-only tests are skipped in the plain pass). Needs Redis
# (SHOP_REDIS_URL, default OJS_TEST_REDIS_URL or redis://127.0.0.1:6379/0); extra arguments go
# to pytest. Usage: bash examples/django_project/run_tests.sh [-q] [-k ...]
# The two passes run at the same time (each has its own run folder, database and Redis key
# prefix; they mostly wait on their workers), and their outputs are printed one after the other.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-../../.venv/bin/python}
export SHOP_REDIS_URL=${SHOP_REDIS_URL:-${OJS_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}}
run_dirs=()
pids=()
set -m  # each pass in its own process group, so that Ctrl-C (forwarded below) reaches it
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait; exit 130' INT TERM
for mode in 0 1; do
    run_dir=$(mktemp -d)
    run_dirs+=("$run_dir")
    SHOP_OJS=$mode SHOP_RUN_DIR=$run_dir SHOP_KEY_PREFIX="shop-$mode-$$-$RANDOM:" \
        "$PY" -m pytest "$@" >"$run_dir/pytest.out" 2>&1 &
    pids+=($!)
done
status=0
for mode in 0 1; do
    code=0
    wait "${pids[$mode]}" || code=$?
    echo "== example shop: $([ $mode = 1 ] && echo 'with ojs_celery' || echo 'plain Celery')" >&2
    cat "${run_dirs[$mode]}/pytest.out"
    rm -rf "${run_dirs[$mode]}"
    [ $code -eq 0 ] || status=1
done
exit $status
