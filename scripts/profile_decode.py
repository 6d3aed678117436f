"""Run one decode scenario eagerly a few times: for Nsight Compute (gpu_check.sh's `profile:decode`
stage: ncu --kernel-name regex:decode_persistent ... python3 scripts/profile_decode.py) and for
compute-sanitizer (tests/test_decode.py's GPU tier)."""

from __future__ import annotations

import argparse

import torch

import hpcops
from hpcops.bench.suites.decode import PAGE, Scenario, make_decode_inputs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="64x4K")
    ap.add_argument("--heads", default="8/1")
    ap.add_argument("--kv", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--schedule", default="dynamic", choices=("dynamic", "static"))
    ap.add_argument("--config", default="", help="DecodeConfig overrides, e.g. tail_merge=1,pdl=0 (ints; 0/1 flags)")
    args = ap.parse_args()
    if args.config:
        from hpcops.attention.decode import decode_config, set_decode_config

        now = decode_config()
        changes = {k: int(v) for k, v in (item.split("=", 1) for item in args.config.split(","))}
        set_decode_config(**{k: bool(v) if isinstance(getattr(now, k), bool) else v for k, v in changes.items()})
    hq, hkv = (int(x) for x in args.heads.split("/"))
    sc = Scenario(args.spec, hq, hkv, args.kv == "fp8")
    x = make_decode_inputs(sc.lens, hq, hkv, sc.fp8, seed=0)
    plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=PAGE)
    for _ in range(3):
        hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                plan=plan if args.schedule == "dynamic" else None, schedule=args.schedule,
                                k_scale=x["k_scale"], v_scale=x["v_scale"], out=x["out"])
    torch.cuda.synchronize()
    print(f"profiled {sc.name}: {sc.bytes / 1e6:.1f} MB of KV per layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
