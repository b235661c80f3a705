#!/usr/bin/env bash
# Run the end-to-end tests on each supported Celery minor version, each in its own scratch
# virtualenv (under .compat/, kept between runs, rebuilt when pyproject.toml changes).
# Each minor is paired with the kombu minor released with it (the one its users run), so the
# oldest combination is tested too, not only what pip would pick.
#
#   scripts/compat.sh                 # every supported version
#   scripts/compat.sh 5.5 5.7         # only these
#   COMPAT_TESTS="tests/test_e2e_core.py" scripts/compat.sh 5.4
#   COMPAT_INSTALL_ONLY=1 scripts/compat.sh 5.4   # only build the venv (CI does it meanwhile)
#
# Prints one summary line per version; exits non-zero if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."

SUPPORTED=(5.4 5.5 5.6 5.7)
TESTS=${COMPAT_TESTS:-"tests/test_compat.py tests/test_e2e_core.py tests/test_e2e_worker.py tests/test_install.py"}
PYTHON=${PYTHON:-python3}
ROOT=${COMPAT_DIR:-.compat}
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=("${SUPPORTED[@]}")
mkdir -p "$ROOT"

status=0
for v in "${versions[@]}"; do
    venv="$ROOT/venv-celery-$v"
    log="$ROOT/celery-$v.log"
    stamp="$venv/.installed"
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
        rm -rf "$venv"
        "$PYTHON" -m venv "$venv"
        echo "celery $v: installing into $venv ..." >&2
        if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check \
                -e ".[test]" "celery~=$v.0" "kombu~=$v.0" >"$log" 2>&1; then
            echo "celery $v: INSTALL FAILED (see $log)"
            status=1
            continue
        fi
        touch "$stamp"
    fi
    [ "${COMPAT_INSTALL_ONLY:-}" = 1 ] && continue
    installed=$("$venv/bin/python" -c '
import importlib.metadata as m
print(" ".join(f"{n} {m.version(n)}" for n in ("celery", "kombu", "billiard", "redis")))')
    echo "$installed: running $TESTS" >&2
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS >"$log" 2>&1
    rc=$?
    counts=$(grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped)|^=+ .*(passed|failed|error).* in " "$log" \
             | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
    echo "$installed: ${counts:-no result (exit $rc), see $log}"
    if [ $rc -ne 0 ]; then
        status=1
        bash scripts/show-failures.sh "$log"
    fi
done
exit $status
