#!/usr/bin/env bash
# The CPU test tier (what CI runs): every kernel through Triton's interpreter, one pytest worker a core
# (pytest-xdist, a test file per worker: HPCOPS_TEST_WORKERS=0 runs them in this process); then the vLLM
# integration's tests again against newer vLLM releases (scripts/vllm_compat.sh; HPCOPS_VLLM_COMPAT=0 skips it).
# Arguments go to pytest and run those tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
export TRITON_INTERPRET=1
workers=${HPCOPS_TEST_WORKERS:-auto}
pytest=(.venv/bin/python -m pytest -q)
if [ "$workers" != 0 ] && .venv/bin/python -c "import xdist" >/dev/null 2>&1; then
  pytest+=(-n "$workers" --dist loadfile)
fi
[ $# -eq 0 ] || exec "${pytest[@]}" "$@"
status=0
"${pytest[@]}" || status=$?
if [ "${HPCOPS_VLLM_COMPAT:-1}" != 0 ]; then
  bash scripts/vllm_compat.sh || status=1
fi
exit $status
