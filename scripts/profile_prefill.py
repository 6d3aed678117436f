"""Run one prefill scenario eagerly a few times, for Nsight Compute (gpu_check.sh's `profile:prefill` stage:
ncu --kernel-name regex:prefill_gluon ... python3 scripts/profile_prefill.py): the bench suite's inputs, our default
(`--q bf16`, bf16 KV: the warp-specialized Gluon kernel on an H200) or an fp8 q over fp8 KV (`--q fp8`: the default
`tl` kernel, or `--gluon` the opt-in fp8 Gluon kernel, the bench's `hpcops-fp8q-gluon` row)."""

from __future__ import annotations

import argparse

import torch

from hpcops.bench.suites import prefill as suite


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="q8k", help="a prefill suite batch spec (q8k, 2q1ks4k, ...)")
    ap.add_argument("--heads", default="64/8")
    ap.add_argument("--q", default="bf16", choices=("bf16", "fp8"), help="fp8: an fp8 q over fp8 KV")
    ap.add_argument("--gluon", action="store_true", help="with --q fp8: the warp-specialized Gluon kernel in fp8")
    args = ap.parse_args()
    if args.gluon and args.q != "fp8":
        raise SystemExit("--gluon is for --q fp8 (a 16-bit q takes the Gluon kernel by default on an H200)")
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py runs on a CUDA GPU")
    hq, hkv = (int(h) for h in args.heads.split("/"))
    s = suite.Scenario(args.spec, hq, hkv, args.q == "fp8")
    x = suite._make_inputs(s, 0, "cuda")
    run = suite._ours(args.q == "fp8", suite.GLUON_FP8 if args.gluon else None)(x)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    print(f"profiled {s.name} ({args.q} q{', Gluon fp8' if args.gluon else ''}): "
          f"{suite.causal_flops(s.reqs, hq, suite.HEAD_DIM) / 1e12:.2f} TFLOP a call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
