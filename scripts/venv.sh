# Sourced by demo.sh and test.sh: create .venv and install the package (with the extras in $1)
# when .venv is new or pyproject.toml changed since the last install.
PYTHON=${PYTHON:-python3}
# Two first runs at once (two demos, a demo beside the tests) would make and install into the
# one .venv together, and one of them would fail: the check and the install run under a lock
# on this file, where flock(1) exists (the second run then finds the install done).
if command -v flock >/dev/null 2>&1; then
    exec 9<scripts/venv.sh
    flock 9
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=".venv/.ojs-installed$1"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "installing ojs_celery$1 into .venv ..." >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".$1" >/dev/null 2>&1 || {
        .venv/bin/python -m pip install --disable-pip-version-check -e ".$1"; exit 1; }
    touch "$stamp"
fi
exec 9<&-  # the lock ends here, not with the program the caller runs next
