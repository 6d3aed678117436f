"""Probe: how well the layer bench's hpcops side hides the shared expert under the routed MoE (issue 11).

At decode sizes both sides of `hpcops bench layer` run the shared expert on an auxiliary stream, as vLLM's
SharedFusedMoE does; the baseline is counted as a perfect overlap, hpcops' layer graph is measured. This
times step 5 (router GEMM, select, shared expert, routed MoE, residual) of the hpcops layer, CUDA-graph replays
over L2-cold layers, in variants:
- `inline`: one stream (no overlap);
- `moe`: the shared expert on the auxiliary stream, forked before the router GEMM, beside the router GEMM,
  select_experts and the routed MoE (whose reduction waits for it: the suite's hpcops side);
and, alone, `norm+router`, `select+moe` (select + routed MoE + residual) and `shared` (the shared expert):
`ideal` = norm+router + max(select+moe, shared). Writes probe_shared_overlap.{md,json} into --out.

    python3 scripts/probe_shared_overlap.py --out DIR [--only B4-u4K-fp8-tp8,...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hpcops.bench.suites import layer as L
from hpcops.bench.timing import graph_time_us, layers_for

CASES = ("B4-u4K-fp8-tp8", "B16-u4K-fp8-tp8", "B64-u4K-fp8-tp8", "B4-u4K-bf16-tp8", "B16-u4K-bf16-tp8",
         "B64-u4K-bf16-tp8", "B4-u4K-fp8-ep8", "B16-u4K-bf16-ep8", "B64-logmix-bf16-ep8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(CASES))
    args = ap.parse_args()
    scen = {s.name: s for s in L.scenarios()}
    rows = []
    for name in args.only.split(","):
        s = scen[name]
        n = layers_for(L.nbytes(s))
        xs = [L.make_inputs(s, i, "cuda") for i in range(n)]
        ms = [L._materialize(s, x) for x in xs]
        res = {"case": name, "layers": n}
        res["norm+router"] = graph_time_us([lambda x=x, m=m: L.step5a_router(x, m["h1"]) for x, m in zip(xs, ms)])
        res["select+moe"] = graph_time_us([lambda x=x, m=m, s=s: L._hp_moe(s, x, m["h1"], m["h2"], *L.step5a_select(
            x, L.step5a_router(x, m["h1"])[1]), m["shared"]) for x, m in zip(xs, ms)]) - res["norm+router"]
        res["shared"] = graph_time_us([lambda x=x, m=m: L.shared_expert(x, m["h2"]) for x, m in zip(xs, ms)])
        res["ideal"] = res["norm+router"] + max(res["select+moe"], res["shared"])
        for variant, beside in (("inline", False), ("moe", True)):
            res[variant] = graph_time_us([lambda x=x, m=m, b=beside, s=s: L.hp_step5(s, x, m["h1"], beside=b)
                                          for x, m in zip(xs, ms)])
        rows.append(res)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
        del xs, ms
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_shared_overlap.json").write_text(json.dumps(rows, indent=1))
    cols = ("norm+router", "select+moe", "shared", "ideal", "inline", "moe")
    lines = ["# step 5 of the hpcops layer: the shared expert beside the routed MoE (µs per layer)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays over L2-cold layers; `select+moe` = select + "
             "routed MoE + residual with the norm and router GEMM's time taken out; `ideal` = norm+router + "
             "max(select+moe, shared).",
             "", "| case | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {r['case']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |" for r in rows]
    (out / "probe_shared_overlap.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
