"""Where a decode step spends its device time: per-kernel µs (plan, attention, combine) of `decode_attention`
on the decode bench's scenarios, per DecodeConfig variant, L2-cold (each layer its own caches), from
torch.profiler. A GPU tool: through gpu_check.sh's `profile:decode-kernels` stage, or

    python3 scripts/profile_decode_kernels.py --only "64x4K h8/1 fp8,64x0.5K h8/1 fp8" \
        --variants "tail_merge=1;gluon=1 pps=3;schedule=static"

fp8-KV scenarios run with the prologue's fp8 q (the bench's `hpcops-fp8q` row; `--q16`: the bf16 q, its
`hpcops` row). The plan step is profiled
beside the attention (`plan_decode(..., out=plan)` every call, as once per step in a model: its buffers are
made once; told the call's dtypes, so over fp8 KV the default is the Gluon kernel with the tail merge at 3
programs an SM, `gluon=0` the `tl` kernel); `pps` = persistent programs per SM (the plan's num_programs; unset:
the plan's choice); `min_tiles`, `task_cost`, `snap` go to `plan_decode`. Each variant prints one table:
kernel, launches per call, µs per call, share.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_moe import per_kernel_us, print_kernel_table  # noqa: E402


def parse_variant(text: str) -> dict:
    """`gluon=1 pps=3 schedule=static` -> {"gluon": True, "pps": 3, "schedule": "static"}."""
    out = {}
    for item in text.split():
        key, _, value = item.partition("=")
        if not value:
            raise ValueError(f"--variants: {item!r} is not key=value")
        out[key] = value if key == "schedule" else int(value)
    return out


def split_variant(variant: dict) -> tuple[dict, dict]:
    """A parsed variant as (DecodeConfig changes, its bool fields from 0 / 1; plan_decode's arguments: the decode
    tuner's plan knobs but pps, which becomes num_programs)."""
    from hpcops.attention.decode import DecodeConfig
    from hpcops.bench.tune.decode import PLAN_KNOBS

    flags = {f.name for f in fields(DecodeConfig) if f.type in (bool, "bool", "bool | None")}
    knobs = {k: bool(v) if k in flags else v for k, v in variant.items() if k != "schedule" and k not in PLAN_KNOBS}
    return knobs, {k: v for k, v in variant.items() if k in PLAN_KNOBS and k != "pps"}


def calls_for(x: dict, variant: dict, q16: bool = False):
    """A no-argument call of one layer's decode step (plan + attention) under `variant`; q16: over fp8 KV the bf16
    q (the bench's `hpcops` row there, the `tl` kernel converting every tile) instead of the prologue's fp8 q."""
    import hpcops
    from hpcops import _platform
    from hpcops.attention import decode as dec

    schedule = variant.get("schedule", "dynamic")
    knobs, plan_args = split_variant(variant)
    pps = variant.get("pps")
    _, page, hkv, d = x["k_cache"].shape
    q, qs = (x["q8"], x["q_scale"]) if "q8" in x and not q16 else (x["q"], None)
    programs = None if pps is None else pps * _platform.num_sms(q.device)

    plan = None
    if schedule == "dynamic":  # the plan's buffers once (their zero-fills are not a step's work); each call
        # re-plans into them; told what the call takes, as a model's step (`decode.plan_kernel`)
        with dec.decode_config_changed(**knobs):
            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page, num_programs=programs,
                                      num_q_heads=q.shape[1], head_dim=d, q_dtype=q.dtype,
                                      kv_dtype=x["k_cache"].dtype, max_seq_len=x["max_seq_len"], **plan_args)

    def run():
        with dec.decode_config_changed(**knobs):
            if plan is not None:
                hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page, out=plan)
            hpcops.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"], plan=plan,
                                    schedule=schedule, k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=qs,
                                    out=x["out"])
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="64x0.5K h8/1 fp8,64x4K h8/1 fp8,32x0.125K+32x4K h8/1 fp8,"
                                       "2x32K+30x4K h8/1 fp8,1x64K+15x4K h8/1 fp8,1x128K+31x4K h8/1 fp8")
    ap.add_argument("--variants", default="gluon=0;gluon=0 tail_merge=1;tail_merge=0;tail_group=0;tail_group=8;"
                                          "schedule=static",
                    help="';'-separated DecodeConfig overrides beside the default, e.g. \"gluon=1 pps=3\"")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--q16", action="store_true", help="over fp8 KV, the bf16 q (the bench's `hpcops` row)")
    args = ap.parse_args()
    from hpcops.bench.suites import decode as suite

    variants = [{}] + [parse_variant(v) for v in args.variants.split(";") if v.strip()]
    wanted = [w.strip() for w in args.only.split(",")]
    known = {s.name: s for s in suite.scenarios()}
    for name in wanted:
        if name not in known:
            raise SystemExit(f"--only: unknown scenario {name!r}; known: {', '.join(known)}")
        s = known[name]
        layers = [suite.make_decode_inputs(s.lens, s.hq, s.hkv, s.fp8, seed=i) for i in range(args.layers)]
        for variant in variants:
            label = (" ".join(f"{k}={v}" for k, v in variant.items()) or "default") + (" q16" if args.q16 else "")
            try:
                times = per_kernel_us([calls_for(x, variant, args.q16) for x in layers])
            except Exception as exc:  # a variant that does not apply here: say so, go on
                print(f"\n{name} {label}: failed ({type(exc).__name__}: {str(exc)[:160]})")
                continue
            print_kernel_table(f"{name} {label}", times)
        del layers
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
