"""Probe: how fast can any kernel read N bytes on this GPU, at the sizes an MoE call reads (issue 9's floor).

Issue 9's second target is floor / ours >= 0.85, the floor being the touched experts' weight bytes at
4.19 TB/s. At small batches those are tens of MB, read by two kernels (gate-up, down). This times a plain
streaming read (grid-stride 16-byte loads, a sum a program so nothing is optimized away) of S MB, for each S,
over 1, 2 and 4 programs an SM, L2-cold (every layer reads its own buffer, all layers >= 3x L2), two ways:
- `kernel µs`: the profiler's device time of the kernel (as the MoE bench's `hpcops-kernels` and `vllm-triton`);
- `graph µs`: CUDA-graph replay, per layer.
It reports the best variant per size and its fraction of 4.19 TB/s; `--pairs 47,24` adds rows for two reads back
to back (summed kernel times), the shape of the gate-up + down weight read. Writes probe_read_floor.{md,json}.

    python3 scripts/probe_read_floor.py --out DIR [--mb 8,16,24,32,47,64,100,200,400] [--pairs 47,24]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from hpcops._platform import num_sms
from hpcops.bench.timing import graph_time_us, layers_for, profiler_kernel_time_us

COPY_CEILING_TBS = 4.19  # DESIGN.md's H200 copy ceiling, the floor rate


@triton.jit
def stream_read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Grid-stride read of n fp32 values, BLOCK a step; each program writes the sum of what it read."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, step):
        idx = start + offs
        acc += tl.load(src_ptr + idx, mask=idx < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_fn(src: torch.Tensor, out: torch.Tensor, programs: int, block: int = 4096):
    n = src.numel()
    return lambda: stream_read_kernel[(programs,)](src, out, n, BLOCK=block, num_warps=8)


def check_read_all(src: torch.Tensor, out: torch.Tensor, what: str) -> None:
    """The per-program sums `read_fn` wrote add up to torch's sum of `src`: a read that got the sum right read every
    byte (RuntimeError naming `what` otherwise)."""
    got, want = out.double().sum().item(), src.double().sum().item()
    if abs(got - want) > 1e-3 * max(1.0, src.abs().double().sum().item()):
        raise RuntimeError(f"stream_read_kernel sums {got} over {what}, torch {want}")


def probe(mb: float, per_sm: int, device: torch.device, *, calls: int = 5) -> dict:
    n = int(mb * 1e6) // 4
    layers = layers_for(n * 4)
    programs = per_sm * num_sms(device)
    srcs = [torch.randn(n, device=device) for _ in range(layers)]
    outs = [torch.empty(programs, device=device) for _ in range(layers)]
    fns = [read_fn(s, o, programs) for s, o in zip(srcs, outs)]
    fns[0]()
    check_read_all(srcs[0], outs[0], f"{mb} MB")
    kernel_us = profiler_kernel_time_us(fns, "stream_read_kernel", calls=calls)
    graph_us = graph_time_us(fns, replays=20)
    return {"mb": mb, "per_sm": per_sm, "layers": layers, "kernel_us": kernel_us, "graph_us": graph_us,
            "kernel_tbs": n * 4 / (kernel_us * 1e-6) / 1e12, "floor_us": n * 4 / (COPY_CEILING_TBS * 1e12) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for probe_read_floor.{md,json}")
    ap.add_argument("--mb", default="8,16,24,32,47,64,100,200,400", help="sizes, MB (1e6 bytes), comma-separated")
    ap.add_argument("--pairs", default="47,24", help="two sizes read back to back, 'A,B;C,D'")
    ap.add_argument("--per-sm", default="1,2,4", help="programs an SM to try")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("probe_read_floor.py needs a CUDA GPU")
    dev = torch.device("cuda")
    sizes = sorted({float(s) for s in a.mb.split(",")} | {float(s) for p in a.pairs.split(";") if p
                                                         for s in p.split(",")})
    rows = [probe(mb, int(p), dev) for mb in sizes for p in a.per_sm.split(",")]
    best = {mb: min((r for r in rows if r["mb"] == mb), key=lambda r: r["kernel_us"]) for mb in sizes}
    lines = ["# probe_read_floor", "",
             f"{torch.cuda.get_device_name()}: a streaming read of S MB, L2-cold, best of {a.per_sm} programs an SM; "
             f"floor = S at {COPY_CEILING_TBS} TB/s (issue 9's rate).", "",
             "| MB | programs/SM | kernel µs | graph µs | TB/s (kernel) | floor µs | floor / kernel |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for mb in sizes:
        r = best[mb]
        lines.append(f"| {mb:g} | {r['per_sm']} | {r['kernel_us']:.1f} | {r['graph_us']:.1f} | {r['kernel_tbs']:.2f} | "
                     f"{r['floor_us']:.1f} | {r['floor_us'] / r['kernel_us']:.2f} |")
    for p in filter(None, a.pairs.split(";")):
        x, y = (float(s) for s in p.split(","))
        k = best[x]["kernel_us"] + best[y]["kernel_us"]
        f = best[x]["floor_us"] + best[y]["floor_us"]
        lines.append(f"| {x:g} + {y:g} (two reads) | | {k:.1f} | | | {f:.1f} | {f / k:.2f} |")
    lines += ["", "Every variant:", "", "| MB | programs/SM | kernel µs | graph µs |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['mb']:g} | {r['per_sm']} | {r['kernel_us']:.1f} | {r['graph_us']:.1f} |" for r in rows]
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "probe_read_floor.md").write_text("\n".join(lines) + "\n")
    (a.out / "probe_read_floor.json").write_text(json.dumps({"rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
