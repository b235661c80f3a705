#!/usr/bin/env bash
# Set up a virtualenv (first run only) and run the zero-setup demo: no server needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e . >/dev/null
exec .venv/bin/python examples/demo.py
