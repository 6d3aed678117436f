"""Probe: the router GEMM at decode sizes (issue 11), variants × sizes in one GPU call.

The fp32 router GEMM (Hy3: E 192 × H 4096, DeepSeek-V3: E 256 × H 7168, weight 3.1 / 7.3 MB) is a weight read:
at 4.19 TB/s it is 0.8 / 1.8 µs, yet `bench/results/router.md` times torch's cast + GEMM at 17–23 µs and
`routing.route`'s split-K `tl.dot` kernel no better. This times, as CUDA-graph replays over L2-cold layers (each
its own weight and hidden), the GEMM alone (logits or partial logits written, no top-k):
- `torch`: `hidden.float() @ weight.t()` (the layer bench's baseline router);
- `dot-BT/BE/BK/P/W`: `router_gemm_kernel` (`routing.route`'s), tiles BT × BE × BK, ~P programs, W warps;
- `gemv-BE/BK/W`: a kernel without `tl.dot`: each program holds one [BE, BK] weight tile in registers and loops
  over the tokens (a multiply and a row sum each): every weight element is read once, by one program;
and the top-k over the partial logits (`select+S`, S splits) against over full logits (`select`). Prints the
torch sequence's kernels (torch.profiler) at T 4. Writes probe_route.{md,json} into --out.

    python3 scripts/probe_route.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from hpcops.bench.timing import graph_time_us, layers_for, profile_per_call_us  # noqa: F401
from hpcops.moe import _moe_kernels as K
from hpcops.moe import routing as R

SHAPES = {"hy3": (192, 4096), "dsv3": (256, 7168)}
TOKENS = (1, 4, 16, 64)
DOT = [(16, 32, 128, 264, 4), (16, 32, 64, 264, 4), (16, 64, 128, 132, 4), (16, 16, 128, 264, 2),
       (16, 32, 256, 132, 4), (16, 32, 128, 528, 4), (32, 32, 128, 264, 4), (64, 32, 64, 264, 4)]
GEMV = [(32, 128, 4), (16, 128, 2), (32, 64, 2), (64, 128, 4), (32, 256, 4), (16, 256, 4), (64, 64, 4), (8, 256, 2)]


@triton.jit
def gemv_kernel(x_ptr, w_ptr, part_ptr, T, E, H, stride_xt, stride_we, stride_ps, stride_pt,
                BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_e, pid_s = tl.program_id(0), tl.program_id(1)
    es = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)
    emask, kmask = es < E, ks < H
    w = tl.load(w_ptr + es.to(tl.int64)[:, None] * stride_we + ks[None, :], mask=emask[:, None] & kmask[None, :],
                other=0.0).to(tl.float32)
    out = part_ptr + pid_s.to(tl.int64) * stride_ps + es
    for t in range(T):
        xv = tl.load(x_ptr + t * stride_xt + ks, mask=kmask, other=0.0).to(tl.float32)
        tl.store(out + t * stride_pt, tl.sum(w * xv[None, :], axis=1), mask=emask)


def _split(t: int, e: int, h: int, bt: int, be: int, bk: int, programs: int) -> tuple[int, int]:
    tiles = triton.cdiv(e, be) * triton.cdiv(max(t, 1), bt)
    want = max(1, min(programs // tiles, triton.cdiv(h, bk)))
    k_split = triton.cdiv(triton.cdiv(h, want), bk) * bk
    return k_split, triton.cdiv(h, k_split)


def _dot(x, cfg):
    bt, be, bk, programs, warps = cfg
    (t, h), e = x["hidden"].shape, x["weight"].shape[0]
    k_split, splits = _split(t, e, h, bt, be, bk, programs)
    parts = torch.empty((splits, t, e), dtype=torch.float32, device="cuda")
    grid = (triton.cdiv(e, be), splits, triton.cdiv(t, bt))

    def fn():
        K.router_gemm_kernel[grid](x["hidden"], x["weight"], parts, t, e, h, k_split, h, h, parts.stride(0),
                                   parts.stride(1), BLOCK_T=bt, BLOCK_E=be, BLOCK_K=bk, num_warps=warps)
        return parts
    return fn, splits


def _gemv(x, cfg):
    be, bk, warps = cfg
    (t, h), e = x["hidden"].shape, x["weight"].shape[0]
    splits = triton.cdiv(h, bk)
    parts = torch.empty((splits, t, e), dtype=torch.float32, device="cuda")
    grid = (triton.cdiv(e, be), splits)

    def fn():
        gemv_kernel[grid](x["hidden"], x["weight"], parts, t, e, h, h, h, parts.stride(0), parts.stride(1),
                          BLOCK_E=be, BLOCK_K=bk, num_warps=warps)
        return parts
    return fn, splits


def _select(parts, bias):
    t, e = parts.shape[1:]
    w = torch.empty((t, 8), dtype=torch.float32, device="cuda")
    ids = torch.empty((t, 8), dtype=torch.int32, device="cuda")
    return lambda: R._launch_select(parts, 8, "sigmoid", bias, True, 2.5, w, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for model, (e, h) in SHAPES.items():
        for t in TOKENS:
            n = layers_for(e * h * 4)
            g = torch.Generator().manual_seed(t)
            xs = [{"hidden": torch.randn(t, h, generator=g).to(torch.bfloat16).cuda(),
                   "weight": (torch.randn(e, h, generator=g) * h ** -0.5).cuda(),
                   "bias": (0.1 * torch.randn(e, generator=g)).cuda()} for _ in range(n)]
            ref = [x["hidden"].double() @ x["weight"].double().t() for x in xs[:1]]
            res = {"model": model, "T": t, "layers": n,
                   "floor_us": (e * h * 4 + t * h * 2) / 4.19e6}
            res["torch"] = graph_time_us([lambda x=x: x["hidden"].float() @ x["weight"].t() for x in xs])
            if t == 4:
                from torch.autograd import DeviceType
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for x in xs[:4]:
                        x["hidden"].float() @ x["weight"].t()
                    torch.cuda.synchronize()
                names = [(ev.name, ev.device_time) for ev in prof.events() if ev.device_type == DeviceType.CUDA]
                res["torch_kernels"] = names[:8]
            for kind, cfgs, make in (("dot", DOT, _dot), ("gemv", GEMV, _gemv)):
                for cfg in cfgs:
                    name = f"{kind}-" + "/".join(map(str, cfg))
                    try:
                        fns = [make(x, cfg) for x in xs]
                        got = fns[0][0]().sum(0)
                        err = float((got.double() - ref[0]).abs().max())
                        res[name] = graph_time_us([f for f, _ in fns])
                        res[name + ":err"] = err
                        res[name + ":splits"] = fns[0][1]
                    except Exception as exc:  # a config that does not compile or fit: a row, not a crash
                        res[name] = float("nan")
                        res[name + ":exc"] = repr(exc)[:200]
            logits = [x["hidden"].float() @ x["weight"].t() for x in xs]
            res["select"] = graph_time_us([_select(lg[None], x["bias"]) for lg, x in zip(logits, xs)])
            for s in (8, 16, 32, 56):
                parts = [torch.randn(s, t, e, device="cuda") for _ in xs]
                res[f"select+{s}"] = graph_time_us([_select(p, x["bias"]) for p, x in zip(parts, xs)])
            rows.append(res)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
            del xs
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_route.json").write_text(json.dumps(rows, indent=1))
    cols = ["floor_us", "torch"] + ["dot-" + "/".join(map(str, c)) for c in DOT] + \
        ["gemv-" + "/".join(map(str, c)) for c in GEMV] + ["select", "select+8", "select+16", "select+32", "select+56"]
    lines = ["# the fp32 router GEMM at decode sizes (µs per layer)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays over L2-cold layers; the GEMM alone (no "
             "top-k) except the select columns (the top-k over full logits, and over S partial sums).", "",
             "| variant | " + " | ".join(f"{r['model']} T{r['T']}" for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    lines += [f"| {c} | " + " | ".join(f"{r.get(c, float('nan')):.1f}" for r in rows) + " |" for c in cols]
    (out / "probe_route.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
