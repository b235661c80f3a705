#!/usr/bin/env bash
# Set up a virtualenv (first run only) and run the zero-setup demo: no server needed.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh ""
exec .venv/bin/python examples/demo.py
