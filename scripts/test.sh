#!/usr/bin/env bash
# The CPU test tier (what CI runs): every kernel through Triton's interpreter, one pytest worker a core
# (pytest-xdist, a test file per worker: HPCOPS_TEST_WORKERS=0 runs them in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
export TRITON_INTERPRET=1
workers=${HPCOPS_TEST_WORKERS:-auto}
if [ "$workers" != 0 ] && .venv/bin/python -c "import xdist" >/dev/null 2>&1; then
  exec .venv/bin/python -m pytest -q -n "$workers" --dist loadfile "$@"
fi
exec .venv/bin/python -m pytest -q "$@"
