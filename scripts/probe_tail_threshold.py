"""Where the Gluon decode kernel's tail merge stops paying against the combine kernel, by request length (h8/1,
fp8 q over fp8 KV, page 64): the tail merge at 3 and 2 programs an SM, the combine kernel at 2 and 3, and the plan's
own choice told the step's longest request (`plan_decode(max_seq_len=...)`, `decode.plan_tail`), each timed like the
bench (graph replay, L2-cold layers). Prints a markdown table: the row where the tail stops winning is where
`decode.GLUON_TAIL_MAX_SEQ` belongs.

    python scripts/probe_tail_threshold.py [--specs 64x0.5K,64x1K,...]
"""

from __future__ import annotations

import argparse

import torch

import hpcops
from hpcops._platform import num_sms
from hpcops.attention import reference
from hpcops.attention.decode import decode_config_changed
from hpcops.bench.scenarios import parse_lengths
from hpcops.bench.suites.decode import make_decode_inputs
from hpcops.bench.timing import graph_time_us, layers_for

VARIANTS = {"tail pps3": (True, 3), "tail pps2": (True, 2), "combine pps2": (False, 2), "combine pps3": (False, 3),
            "plan told max_seq_len": (None, None)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default="64x0.5K,64x1K,64x1.5K,64x2K,64x3K,64x4K,128x1K,128x2K,32x2K,16x4K,256x0.5K")
    args = ap.parse_args()
    print("| spec | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for spec in args.specs.split(","):
        lens = parse_lengths(spec)
        one = make_decode_inputs(lens, 8, 1, True, 0)
        nbytes = one["k_cache"].numel() * 2
        del one
        layers = layers_for(nbytes)
        xs = [make_decode_inputs(lens, 8, 1, True, i) for i in range(layers)]
        cells = []
        for tail, pps in VARIANTS.values():
            knobs = {} if tail is None else {"tail_merge": tail}

            def prep(x, knobs=knobs, pps=pps):
                with decode_config_changed(**knobs):
                    plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=1, block_size=64, num_q_heads=8,
                                              head_dim=128, q_dtype=x["q8"].dtype, kv_dtype=x["k_cache"].dtype,
                                              num_programs=pps * num_sms(x["q"].device) if pps else None,
                                              max_seq_len=x["max_seq_len"])

                def run():
                    with decode_config_changed(**knobs):
                        return hpcops.decode_attention(x["q8"], x["k_cache"], x["v_cache"], x["block_table"],
                                                       x["seq_lens"], plan=plan, k_scale=x["k_scale"],
                                                       v_scale=x["v_scale"], q_scale=x["q_scale"], out=x["out"])
                return run
            fns = [prep(x) for x in xs]
            ref = reference.decode_attention(
                xs[0]["q8"], xs[0]["k_cache"], xs[0]["v_cache"], xs[0]["block_table"], xs[0]["seq_lens"],
                k_scale=xs[0]["k_scale"], v_scale=xs[0]["v_scale"], q_scale=xs[0]["q_scale"])
            err = (fns[0]().float() - ref.float()).abs().max().item()
            assert err < 5e-2, f"{spec} {tail} {pps}: max error {err}"
            cells.append(f"{graph_time_us(fns):.1f}")
        print(f"| {spec} | " + " | ".join(cells) + " |", flush=True)
        del xs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
