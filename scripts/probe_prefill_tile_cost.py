"""Probe: what a q tile costs the Gluon prefill kernels besides its K/V steps (issue 12).

A linear fit of the bench's h8/1 rows (q4k: ~2 q tiles an SM of ~16 steps, q8k: ~4 of ~32) puts the fp8 kernel's
step at ~1.28 µs and ~7.7 µs more for every q tile, the bf16 kernel's at ~1.75 µs and ~4.4 µs a tile (H100, session
63): if so, the per-tile cost, not the step, is what keeps h8/1 fp8 short of 1.3x our bf16. This measures it
directly, with no load imbalance: R requests of 16 new tokens at h8/1 (one 128-row q tile each: 16 tokens x 8
heads), each over n·128 keys (n K/V steps, the last one masked), R = a multiple of the SM count, so every SM runs
R / SMs tiles of the same n. Per kernel and R, the time against n is a line: slope = a step, intercept / (R / SMs) =
a tile's fixed cost (launch, q load, first S and softmax, the producer's fill, the epilogue).

Kernels: `bf16` (the warp-specialized bf16 kernel on the bf16 default's tile at h8/1 q4k, `gluon_config`), `fp8`
(the fp8 kernel a program a q tile: `gluon_config(fp8=True)` without its persistent prefetch, the fp8-q default until
session 66), `fp8-persist` (the same as a persistent grid), `fp8-smemq` (q from
shared memory: no conversion of q into the wgmma's register layout when a tile starts), `fp8-prefetch` (persistent,
the producer TMAs each tile's metadata, q and scales ahead: `gluon_prefetch`), `fp8-queue` (the same taking its
tiles from a counter: `gluon_queue`). CUDA-graph µs a layer,
L2-cold as the bench.

    python3 scripts/probe_prefill_tile_cost.py --out DIR [--steps 1,2,4,8,16,32] [--per-sm 1,2] [--kernels fp8,bf16]
        [--label NAME] [--shared-kv] [--api]

The kernel is launched on exactly R programs (`prefill._launch_gluon`); `--api` goes through `prefill_attention`,
whose grid is a bound from host shapes, (Σ q_len + B·(T − 1)) / T = ~2R here: R programs find no tile and exit
(the first run, session 64, did that). Every request reads its
own pages (L2-cold, as the bench's inputs: the step then costs its K/V's DRAM time, 64 KB bf16 or 32 KB fp8 an SM);
`--shared-kv` points every request's block table at request 0's pages, so the K/V stay in L2 as the bench's h8/1
rows' (one request: every q tile reads the same keys) and the step costs its compute.

`--label` names the files (probe_prefill_tile_cost_NAME.{md,json}) and the tree in the title: an A/B of two trees in
one device call runs the script twice, the other tree first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch
import triton

from hpcops._platform import num_sms
from hpcops.attention.prefill import _launch_gluon, gluon_config, prefill_attention
from hpcops.bench.suites.prefill import HEAD_DIM, Scenario, _make_inputs
from hpcops.bench.timing import graph_time_us, layers_for

HQ, HKV = 8, 1


def _configs() -> dict:
    bf16 = gluon_config(head_dim=HEAD_DIM, group=HQ // HKV, max_seqlen_q=4096, num_kv_heads=HKV, total_q=4096)
    fp8 = dataclasses.replace(gluon_config(head_dim=HEAD_DIM, group=HQ // HKV, max_seqlen_q=4096, fp8=True),
                              gluon_persist=False, gluon_prefetch=False)
    return {"bf16": bf16, "fp8": fp8, "fp8-persist": dataclasses.replace(fp8, gluon_persist=True),
            "fp8-smemq": dataclasses.replace(fp8, gluon_q_regs=False),
            "fp8-prefetch": dataclasses.replace(fp8, gluon_persist=True, gluon_prefetch=True),
            "fp8-queue": dataclasses.replace(fp8, gluon_persist=True, gluon_prefetch=True, gluon_queue=True)}


def _report(out: Path, label: str, mode: str, kernels: list[str], steps: list[int], sms: int, rows: list[dict],
            fits: list[dict]) -> str:
    """Write the tables so far (rewritten after every kernel: a call cut short keeps what it measured)."""
    import hpcops

    tree = f", {label}: {Path(hpcops.__file__).parent}" if label else ""
    lines = [f"# Prefill q-tile cost probe ({torch.cuda.get_device_name()}, {sms} SMs{tree})", "",
             "`python3 scripts/probe_prefill_tile_cost.py` (h8/1, 16 new tokens a request = one 128-row q tile, "
             "n·128 keys, R = tiles an SM × SMs requests; CUDA-graph µs a layer, each layer its own inputs)", "", mode,
             "",
             "| kernel | tiles / SM | " + " | ".join(f"n={n}" for n in steps) + " |",
             "|---|---:|" + "---:|" * len(steps)]
    for per_sm in sorted({r["tiles_per_sm"] for r in rows}):
        for name in kernels:
            ts = [r["us"] for r in rows if r["kernel"] == name and r["tiles_per_sm"] == per_sm]
            lines.append(f"| {name} | {per_sm} | " + " | ".join(f"{t:.2f}" for t in ts) + " |")
    lines += ["", "Least-squares line over n (x = steps an SM): µs a K/V step, and the intercept per q tile.", "",
              "| kernel | tiles / SM | µs a step | µs a q tile (intercept / tiles) |", "|---|---:|---:|---:|"]
    lines += [f"| {f['kernel']} | {f['tiles_per_sm']} | {f['step_us']:.3f} | {f['tile_us']:.2f} |" for f in fits]
    out.mkdir(parents=True, exist_ok=True)
    stem = "probe_prefill_tile_cost" + (f"_{label}" if label else "")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"label": label, "rows": rows, "fits": fits}, indent=1))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", default="1,2,4,8,16,32")
    ap.add_argument("--per-sm", default="1,2")
    ap.add_argument("--kernels", default=",".join(_configs()), help="a comma list of: " + ", ".join(_configs()))
    ap.add_argument("--label", default="", help="names the output files and the tree")
    ap.add_argument("--shared-kv", action="store_true", help="every request reads request 0's pages (L2-resident)")
    ap.add_argument("--api", action="store_true", help="through prefill_attention (its grid: ~2R programs)")
    args = ap.parse_args()
    configs = _configs()
    kernels = args.kernels.split(",")
    unknown = sorted(set(kernels) - set(configs))
    if unknown:
        ap.error(f"--kernels: unknown {unknown}; choose from {sorted(configs)}")
    steps = [int(s) for s in args.steps.split(",")]
    if len(set(steps)) < 2:
        ap.error("--steps: two step counts at least (the fit is a line)")
    sms = num_sms()
    mode = (f"Grid: {'prefill_attention (~2R programs)' if args.api else 'exactly R programs'}; K/V: "
            f"{'request 0 pages for all (L2-resident)' if args.shared_kv else 'own pages a request (L2-cold)'}.")
    rows, fits = [], []
    for per_sm in (int(s) for s in args.per_sm.split(",")):
        reqs = per_sm * sms
        for name in kernels:
            config = configs[name]
            fp8 = name.startswith("fp8")
            times = []
            for n in steps:
                s = Scenario(f"{reqs}q16s{n * 128}", HQ, HKV, fp8)
                layers = layers_for(s.bytes, maximum=32)
                fns, outs = [], []
                for layer in range(layers):
                    x = _make_inputs(s, layer)
                    kv = x["kv"]
                    q, q_scale = (x["q8"], x["q_scale"]) if fp8 else (x["q"], None)
                    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
                    outs.append(out)
                    bt = kv.block_table
                    if args.shared_kv:
                        bt = bt[:1].expand_as(bt).contiguous()
                    if args.api:
                        kw = dict(max_seqlen_q=x["max_q"], k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=q_scale,
                                  out=out, config=config)
                        fns.append(lambda q=q, kv=kv, x=x, bt=bt, kw=kw: prefill_attention(
                            q, kv.k_cache, kv.v_cache, bt, kv.seq_lens, x["cu"], **kw))
                    else:  # R programs, one a q tile (block_b by prefill_attention's rule)
                        fns.append(lambda q=q, kv=kv, x=x, bt=bt, out=out, q_scale=q_scale, config=config,
                                   reqs=reqs:
                                   _launch_gluon(q, kv.k_cache, kv.v_cache, bt, kv.seq_lens, x["cu"], out, x["scale"],
                                                 reqs, max(16, triton.next_power_of_2(reqs)), config, q_scale,
                                                 kv.k_scale, kv.v_scale))
                fns[0]()
                torch.cuda.synchronize()
                if not torch.isfinite(outs[0]).all():  # every row is written (the outputs start NaN)
                    raise RuntimeError(f"{name} {s.spec}: non-finite output")
                us = graph_time_us(fns)
                times.append(us)
                rows.append({"kernel": name, "tiles_per_sm": per_sm, "steps": n, "us": us})
                print(f"{name:12s} {per_sm} tile(s)/SM  n={n:3d}  {us:8.2f} µs", flush=True)
            slope, icpt = statistics.linear_regression([per_sm * n for n in steps], times)
            fits.append({"kernel": name, "tiles_per_sm": per_sm, "step_us": slope, "tile_us": icpt / per_sm})
            _report(args.out, args.label, mode, kernels, steps, sms, rows, fits)
    print(_report(args.out, args.label, mode, kernels, steps, sms, rows, fits))


if __name__ == "__main__":
    main()
