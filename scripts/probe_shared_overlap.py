"""Probe: how well the layer bench's hpcops side hides the shared expert under the routed MoE (issue 11).

At decode sizes both sides of `hpcops bench layer` run the shared expert on an auxiliary stream, as vLLM's
SharedFusedMoE does; the baseline is counted as a perfect overlap, hpcops' layer graph is measured. This
times step 5 (router GEMM, select, shared expert, routed MoE, residual) of the hpcops layer, CUDA-graph replays
over L2-cold layers, in variants:
- `inline`: the shared expert on the main stream before the MoE (no overlap);
- `aux`: the auxiliary stream forked after the router GEMM (as vLLM forks it);
- `aux-early`: forked before the router GEMM (the suite's hpcops side);
and, alone, `moe` (select + routed MoE + residual) and `shared` (the shared expert): `ideal` = 5a's router
GEMM + max(moe, shared). Writes probe_shared_overlap.{md,json} into --out.

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


def step5(s, x, m, variant: str):
    h1 = m["h1"]
    if variant == "inline":
        h2, tw, ids, shared = L.step5a_router_shared(x, h1)
        return L._hp_moe(s, x, h1, h2, tw, ids, shared)
    early = "early" in variant
    h2 = L._rms(h1, x["w_post"])
    if early:
        shared, ready = L.fork_shared_expert(x, h2)
    logits = L.router_logits(x, h2)
    if not early:
        shared, ready = L.fork_shared_expert(x, h2)
    tw, ids = L.step5a_select(x, logits)
    y = L._hp_moe(s, x, h1, h2, tw, ids, shared, ready)
    L.join_aux(h1.device)
    return y


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
        res["router"] = graph_time_us([lambda x=x, m=m: L.step5a_router(x, m["h1"]) for x, m in zip(xs, ms)])
        res["moe"] = graph_time_us([lambda x=x, m=m, s=s: L._hp_moe(s, x, m["h1"], m["h2"], *L.step5a_select(
            x, L.step5a_router(x, m["h1"])[1]), m["shared"]) for x, m in zip(xs, ms)]) - res["router"]
        res["shared"] = graph_time_us([lambda x=x, m=m: L.shared_expert(x, m["h2"]) for x, m in zip(xs, ms)])
        res["ideal"] = res["router"] + max(res["moe"], res["shared"])
        for variant in ("inline", "aux", "aux-early"):
            res[variant] = graph_time_us([lambda x=x, m=m, v=variant, s=s: step5(s, x, m, v) for x, m in zip(xs, ms)])
        rows.append(res)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
        del xs, ms
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_shared_overlap.json").write_text(json.dumps(rows, indent=1))
    cols = ("router", "moe", "shared", "ideal", "inline", "aux", "aux-early")
    lines = ["# step 5 of the hpcops layer: the shared expert beside the routed MoE (µs per layer)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays over L2-cold layers; `moe` = select + "
             "routed MoE + residual with the router GEMM's time taken out; `ideal` = router + max(moe, shared).",
             "", "| case | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {r['case']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |" for r in rows]
    (out / "probe_shared_overlap.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
