#!/usr/bin/env bash
# The CPU test tier (what CI runs): every kernel through Triton's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
export TRITON_INTERPRET=1
exec .venv/bin/python -m pytest -q "$@"
