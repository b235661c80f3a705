#!/usr/bin/env bash
# Install the lowest version of every dependency that pyproject.toml allows (the floors) in a
# scratch virtualenv and run the store contract suite (SQLite, PostgreSQL, Redis), the SQLite
# store's lane (SQLAlchemy's pool hands it its connection), the Redis store's own tests (its
# lane and scripts, the joint write and the kept client through kombu's Redis channel and
# QoS, the queue bound once per channel; a store_url the server refuses, which redis-py 5 says
# in other words than 8) and the tests of what the other floors carry
# (pydantic: envelope and settings; click: the CLI), on the oldest supported Python.
# Raise a floor in pyproject.toml and here together.
#
#   scripts/floors.sh                       # venv under .compat/, kept between runs
#   FLOORS_TESTS="tests/test_store_contract.py -k redis" scripts/floors.sh
#   FLOORS_INSTALL_ONLY=1 scripts/floors.sh     # only build the venv (CI does it meanwhile)
set -uo pipefail
cd "$(dirname "$0")/.."

# The oldest supported Celery, with the kombu and billiard it was released with.
FLOORS=(
    "celery==5.4.0" "kombu==5.4.2" "billiard==4.2.0"
    "amqp==5.2.0"                 # 5.1.1 (kombu 5.4.2's floor) lets a RabbitMQ nack out unwrapped
    "pydantic==2.6.2"             # 2.6.1 and older (pydantic-core 2.16.2) take "2030-01-02" as an aware datetime
    "SQLAlchemy==2.0.28"          # 2.0.27 and older drop an INSERT's rowcount (preserve_rowcount)
    "click==8.1.2"                # Celery 5.4 to 5.6 ask for 8.1.2 (5.7: 8.3.1)
    "redis==5.0.8"                # 5.0.7 and older drop a unix socket's socket_timeout
    "hiredis==2.1.0"              # the oldest with wheels for Python 3.11
    "psycopg==3.1.4" "psycopg-binary==3.1.4"   # the oldest binary wheels for Python 3.11
)
TESTS=${FLOORS_TESTS:-"tests/test_store_contract.py tests/test_sqlite_lane.py tests/test_redis_indexes.py tests/test_joint.py tests/test_kept_client.py tests/test_publish_binding.py tests/test_enqueue_interrupted.py tests/test_compat.py tests/test_envelope.py tests/test_conf.py tests/test_cli.py tests/test_redis_misconfigured.py"}
# The oldest Python that pyproject.toml allows is a floor too: taken where this machine has it
# (on the PATH, or among pyenv's versions), else python3; PYTHON=... chooses another.
OLDEST_PYTHON=3.10
oldest_python() {
    local candidate
    for candidate in "python$OLDEST_PYTHON" \
            "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/"$OLDEST_PYTHON".*/bin/python; do
        if "$candidate" -c "import sys; sys.exit('%d.%d' % sys.version_info[:2] != '$OLDEST_PYTHON')" \
                2>/dev/null; then
            echo "$candidate"
            return
        fi
    done
    echo python3
}
PYTHON=${PYTHON:-$(oldest_python)}
ROOT=${COMPAT_DIR:-.compat}
venv="$ROOT/venv-floors"
log="$ROOT/floors.log"
mkdir -p "$ROOT"
wanted=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])')

if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ] \
        || [ "$0" -nt "$venv/.installed" ] || [ "$(cat "$venv/.installed")" != "$wanted" ]; then
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    echo "floors: installing into $venv ..." >&2
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check \
            -e ".[test]" "${FLOORS[@]}" >"$log" 2>&1; then
        echo "floors: INSTALL FAILED (see $log)"
        exit 1
    fi
    echo "$wanted" >"$venv/.installed"
fi
[ "${FLOORS_INSTALL_ONLY:-}" = 1 ] && exit 0
installed=$("$venv/bin/python" -c '
import importlib.metadata as m
import sys
names = ("celery", "kombu", "billiard", "pydantic", "SQLAlchemy", "click", "redis", "hiredis",
         "psycopg")
print(f"Python {sys.version.split()[0]}", *(f"{n} {m.version(n)}" for n in names))')
echo "floors: $installed" >&2
# shellcheck disable=SC2086
"$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS >"$log" 2>&1
rc=$?
counts=$(grep -E "^=+ .*(passed|failed|error).* in |^[0-9]+ (passed|failed)" "$log" | tail -1 \
         | sed 's/=//g; s/^ *//; s/ *$//')
echo "floors ($installed): ${counts:-no result (exit $rc), see $log}"
[ $rc -ne 0 ] && bash scripts/show-failures.sh "$log"
exit $rc
