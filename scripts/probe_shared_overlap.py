"""Probe: how well the layer bench's hpcops side hides the shared expert under the routed MoE (issue 11).

At decode sizes the baseline of `hpcops bench layer` runs the shared expert on an auxiliary stream, as vLLM's
SharedFusedMoE does, and is counted as a perfect overlap; hpcops' layer graph is measured. This times step 5
(norm, `routing.route`, shared expert, routed MoE, residual) of the hpcops layer, CUDA-graph replays over
L2-cold layers, in its `shared_mode`s (`layer.hp_step5`):
- `inline`: torch's shared expert, then the routed MoE (one stream, no overlap);
- `aux`: torch's shared expert on the auxiliary stream, forked before the router GEMM, beside the router,
  select_experts and the routed MoE (whose reduction waits for it: the suite's hpcops side up to `3803e6b`);
- `fused`: the shared expert inside the routed MoE's GEMM kernels (`fused_moe(shared_w13=, shared_w2=)`);
and, alone, `norm+route`, `moe` (routed MoE + residual, the shared output given) and `shared` (torch's shared
expert): `ideal` = norm+route + max(moe, shared). Writes probe_shared_overlap.{md,json} into --out.

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
        res["norm+route"] = graph_time_us([lambda x=x, m=m: L.hp_route(x, L._rms(m["h1"], x["w_post"]))
                                           for x, m in zip(xs, ms)])
        res["moe"] = graph_time_us([lambda x=x, m=m, s=s: L._hp_moe(s, x, m["h1"], m["h2"], m["tw"], m["ids"],
                                                                     m["shared"]) for x, m in zip(xs, ms)])
        res["shared"] = graph_time_us([lambda x=x, m=m: L.shared_expert(x, m["h2"]) for x, m in zip(xs, ms)])
        res["ideal"] = res["norm+route"] + max(res["moe"], res["shared"])
        for mode in L.SHARED_MODES:
            res[mode] = graph_time_us([lambda x=x, m=m, s=s, mode=mode: L.hp_step5(s, x, m["h1"], shared_mode=mode)
                                       for x, m in zip(xs, ms)])
        rows.append(res)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
        del xs, ms
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_shared_overlap.json").write_text(json.dumps(rows, indent=1))
    cols = ("norm+route", "moe", "shared", "ideal", *L.SHARED_MODES)
    lines = ["# step 5 of the hpcops layer: the shared expert beside the routed MoE (µs per layer)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUDA-graph replays over L2-cold layers; `moe` = the routed "
             "MoE + residual (the shared output given); `ideal` = norm+route + max(moe, shared); `inline` / `aux` "
             "/ `fused`: step 5 with the shared expert in line, on the auxiliary stream, in the MoE's kernels.",
             "", "| case | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {r['case']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |" for r in rows]
    (out / "probe_shared_overlap.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
