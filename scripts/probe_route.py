"""Probe: the router GEMM at decode sizes (issue 11), variants × sizes in one GPU call.

The fp32 router GEMM (Hy3: E 192 × H 4096, DeepSeek-V3: E 256 × H 7168, weight 3.1 / 7.3 MB) is a weight read:
at 4.19 TB/s it is 0.8 / 1.8 µs, yet torch's cast + GEMM (cuBLAS' SIMT sgemm + its split-K reduce) takes 6–25 µs.
The first run (`bench/results/probe_route_3dff994.md`) found `tl.dot`'s fp32 FMA lowering 12–68 µs and a
register-tile GEMV 2.7 µs at T 1 but 0.7 µs more a token; the second (`probe_route_b2499f1.md`) a broadcast
product summed over K 4.4 µs at T 1, 15–40 at T 16. This times `routing.router_partials` (now three bf16 MMAs
over the split fp32 weight) in launch variants, alone and with the top-k over its partial sums (`+select`, what
`routing.route` launches), against torch's GEMM and torch's GEMM + `select_experts`: CUDA-graph replays over
L2-cold layers, each its own weight and hidden. Prints the torch sequence's kernels (torch.profiler) at T 4.
`--set large` (the default): T 64–8192, the prefill tiles against the decode tiles and torch; `--set decode`:
T 1–64, the decode tiles. Also each variant's precision: max |Σ partials − x·w (fp64)| / Σ|x·w| (`:rel`; torch's
fp32 GEMM's as `torch:rel`). Writes probe_route_<set>.{md,json} into --out.

    python3 scripts/probe_route.py --out DIR [--set large|decode]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hpcops.bench.timing import graph_time_us, layers_for
from hpcops.moe import routing as R

SHAPES = {"hy3": (192, 4096), "dsv3": (256, 7168)}
# (max_block_t, block_e, block_k, warps, programs[, stages]): routing.router_launch's arguments
DECODE = [(32, 32, 128, 4, 264), (16, 32, 128, 4, 264), (64, 32, 128, 4, 264), (16, 32, 64, 4, 264),
          (16, 64, 128, 4, 264), (16, 32, 256, 4, 264), (16, 32, 128, 4, 528), (16, 32, 128, 4, 132),
          (32, 64, 64, 4, 264), (16, 16, 128, 4, 264), (32, 32, 64, 4, 528), (64, 64, 64, 4, 264),
          (16, 32, 128, 2, 264), (64, 32, 64, 8, 264), (32, 32, 256, 4, 264), (64, 64, 128, 8, 264)]
# probe_route_large_5820d34: E-major tiles (the split weight as the left operand) no faster than these, and less
# precise; the 128 × 64 × 64 tile on 8 warps the fastest there and in probe_route_large_c909b5f
LARGE = [(16, 32, 128, 4, 264), (128, 64, 64, 8, 264, 3), (128, 64, 64, 4, 264, 3), (256, 64, 64, 8, 264, 3),
         (128, 64, 32, 8, 264, 4), (128, 64, 64, 8, 528, 3)]
SETS = {"decode": ((1, 4, 16, 32, 64), DECODE), "large": ((64, 128, 256, 512, 2048, 8192), LARGE)}


def _name(cfg) -> str:
    name = "bt{}-e{}-k{}-w{}-p{}".format(*cfg[:5])
    return name + f"-s{cfg[5]}" if len(cfg) > 5 else name


def _ours(x, cfg):
    """→ (the GEMM alone, the GEMM + top-k: `routing.route`'s two launches), the launch."""
    (t, h), e = x["hidden"].shape, x["weight"].shape[0]
    stages = cfg[5] if len(cfg) > 5 else 3
    lc = R.router_launch(t, e, h, max_block_t=cfg[0], block_e=cfg[1], block_k=cfg[2], warps=cfg[3],
                         programs=cfg[4], stages=stages)
    w = torch.empty((t, 8), dtype=torch.float32, device="cuda")
    ids = torch.empty((t, 8), dtype=torch.int32, device="cuda")

    def both():
        parts = R.router_partials(x["hidden"], x["weight"], lc)
        R._launch_select(parts, 8, "sigmoid", x["bias"], True, 2.5, w, ids)
        return parts
    return (lambda: R.router_partials(x["hidden"], x["weight"], lc)), both, lc


def _torch_select(x):
    logits = x["hidden"].float() @ x["weight"].t()
    return R.select_experts(logits, 8, scoring="sigmoid", bias=x["bias"], scale=2.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", choices=sorted(SETS), default="large",
                    help="decode: T 1-64, the decode tiles; large: T 256-8192, the prefill tiles and the decode "
                         "default")
    args = ap.parse_args()
    tokens, configs = SETS[args.set]
    rows = []
    for model, (e, h) in SHAPES.items():
        for t in tokens:
            n = layers_for(e * h * 4 + t * h * 2)
            g = torch.Generator().manual_seed(t)
            xs = [{"hidden": torch.randn(t, h, generator=g).to(torch.bfloat16).cuda(),
                   "weight": (torch.randn(e, h, generator=g) * h ** -0.5).cuda(),
                   "bias": (0.1 * torch.randn(e, generator=g)).cuda()} for _ in range(n)]
            ref = xs[0]["hidden"].double() @ xs[0]["weight"].double().t()
            mag = xs[0]["hidden"].double().abs() @ xs[0]["weight"].double().abs().t()

            def rel(got, ref=ref, mag=mag):
                return float(((got.double() - ref).abs() / mag).max())
            res = {"model": model, "T": t, "layers": n,
                   "floor_us": (e * h * 4 + t * h * 2) / 4.19e6,
                   "mma_floor_us": 3 * 2 * t * e * h / 800e6}  # three bf16 MMAs at ~800 TFLOP/s
            res["torch:rel"] = rel(xs[0]["hidden"].float() @ xs[0]["weight"].t())
            res["torch"] = graph_time_us([lambda x=x: x["hidden"].float() @ x["weight"].t() for x in xs])
            res["torch+select"] = graph_time_us([lambda x=x: _torch_select(x) for x in xs])
            for cfg in configs:
                name = _name(cfg)
                try:
                    fns = [_ours(x, cfg) for x in xs]
                    got = fns[0][0]().sum(0)
                    res[name + ":rel"] = rel(got)
                    res[name + ":splits"] = fns[0][2].splits
                    res[name] = graph_time_us([f[0] for f in fns])
                    res[name + "+select"] = graph_time_us([f[1] for f in fns])
                except Exception as exc:  # a config that does not compile or fit: a row, not a crash
                    res[name] = res[name + "+select"] = float("nan")
                    res[name + ":exc"] = repr(exc)[:200]
            rows.append(res)
            print(json.dumps({k: float(f"{v:.3g}") if isinstance(v, float) else v for k, v in res.items()}),
                  flush=True)
            del xs
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"probe_route_{args.set}.json").write_text(json.dumps(rows, indent=1))
    cols = ["floor_us", "mma_floor_us", "torch", "torch+select"]
    cols += [c for cfg in configs for c in (_name(cfg), _name(cfg) + "+select")]
    lines = [f"# the fp32 router GEMM, `--set {args.set}` (µs per layer)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays over L2-cold layers; the GEMM alone, and "
             "`+select` with the top-k (sigmoid, bias, k 8) over its logits or partial sums: `routing.route`. "
             "Variants `bt/e/k/w/p[-s]`: routing.router_launch(max_block_t, block_e, block_k, warps, programs, "
             "stages). `:rel`: max |Σ partials − x·w (fp64)| / Σ|x·w|.", "",
             "| variant | " + " | ".join(f"{r['model']} T{r['T']}" for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    lines += [f"| {c} | " + " | ".join(f"{r.get(c, float('nan')):.1f}" for r in rows) + " |" for c in cols]
    rels = ["torch:rel"] + [_name(cfg) + ":rel" for cfg in configs]
    lines += ["", "precision, max |Σ partials − x·w (fp64)| / Σ|x·w| (fp32's unit roundoff: 6.0e-8)", "",
              "| variant | " + " | ".join(f"{r['model']} T{r['T']}" for r in rows) + " |",
              "|---|" + "---:|" * len(rows)]
    lines += [f"| {c} | " + " | ".join(f"{r.get(c, float('nan')):.1e}" for r in rows) + " |" for c in rels]
    (out / f"probe_route_{args.set}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
