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
