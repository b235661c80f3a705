# Sourced by demo.sh and test.sh: create .venv and install the package (with the extras in $1)
# when .venv is new or pyproject.toml changed since the last install.
PYTHON=${PYTHON:-python3}
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
