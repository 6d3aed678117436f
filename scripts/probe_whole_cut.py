"""Probe: does the plan's whole cut pay where its cost model says so (issue 10, `plan.whole_pays`)?

For each case (a length spec at some heads, bf16 KV or with `fp8` fp8 KV under a bf16 q: the bench's `hpcops` row,
the `tl` kernel's plan in both), CUDA-graph µs per layer (the
bench's method: the decode suite's inputs, L2-cold, one graph of layers) of the dynamic decode under three cuts,
interleaved over rounds, and the cut the default plan made:

- `model`: the default config (the cost model picks the whole or the equal cut);
- `equal`: `DecodeConfig.split_cost=0` (the equal cut: requests split across programs, merged after);
- `whole`: `split_cost=256` (the whole cut wherever a bucket of whole pairs exists at all);
- `static`: the classic split-KV grid (`schedule="static"`), the ablation the plan must not lose to.

    python3 scripts/probe_whole_cut.py --out DIR [--cases '16x2K h64/8,32x1K h8/1,64x0.5K h8/1 fp8'] [--rounds 3]

Writes DIR/probe_whole_cut.{json,md}. The default cases: the two the model moved to the whole cut in session 49
(8x1K, 16x2K at h64/8), the shapes nearest its threshold at h8/1 (32x1K, 48x1K, 128x4K), and controls the model
keeps as before (64x0.5K whole, 64x4K equal).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

CASES = "8x1K h64/8,16x2K h64/8,32x1K h8/1,48x1K h8/1,128x4K h8/1,16x1K h8/1,64x0.5K h8/1,64x4K h8/1,32x1K h64/8"
CUTS = {"model": {}, "equal": {"split_cost": 0}, "whole": {"split_cost": 256}}


def _case(name: str):
    """'64x0.5K h8/1' or '64x0.5K h8/1 fp8' -> (spec, hq, hkv, fp8 KV)."""
    parts = name.split()
    heads = re.fullmatch(r"h(\d+)/(\d+)", parts[1]) if len(parts) in (2, 3) else None
    if heads is None or parts[2:] not in ([], ["fp8"]):
        raise ValueError(f"--cases: a case is 'SPEC hQ/KV' or 'SPEC hQ/KV fp8', got {name!r}")
    return parts[0], int(heads[1]), int(heads[2]), len(parts) == 3


def time_case(name: str, rounds: int, device: str = "cuda", timer=None, layers: int | None = None) -> dict:
    """The case's µs per layer under each cut (`timer`: graph_time_us; a CPU test passes its own, with
    `layers`), each cut's output checked against the model's first."""
    import torch

    import hpcops
    from hpcops.attention import decode as dec
    from hpcops.bench.suites.decode import PAGE, Scenario, make_decode_inputs
    from hpcops.bench.timing import graph_time_us, layers_for

    spec, hq, hkv, fp8 = _case(name)
    sc = Scenario(spec, hq, hkv, fp8)
    timer = timer or graph_time_us
    xs = [make_decode_inputs(sc.lens, hq, hkv, fp8, seed=i, device=device)
          for i in range(layers or layers_for(int(sc.bytes)))]
    x0 = xs[0]
    hints = dict(num_kv_heads=hkv, block_size=PAGE, num_q_heads=hq, head_dim=x0["q"].shape[-1],
                 q_dtype=x0["q"].dtype, kv_dtype=x0["k_cache"].dtype)

    def fns(schedule: str, plan):
        return [lambda x=x: hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"],
                                                    x["seq_lens"], plan=plan, schedule=schedule, k_scale=x["k_scale"],
                                                    v_scale=x["v_scale"], out=x["out"])
                for x in xs]

    want = None
    times: dict[str, list[float]] = {k: [] for k in (*CUTS, "static")}
    cut = {}
    for r in range(rounds):
        for label, knobs in CUTS.items():
            with dec.decode_config_changed(**knobs):
                plan = hpcops.plan_decode(x0["seq_lens"], **hints)
                if r == 0:
                    used = plan.host_tables()
                    cut[label] = {"whole": used["used_snap"] == 2147483647, "bucket": used["header"][0],
                                  "active": used["header"][3]}
                    got = fns("dynamic", plan)[0]().float().clone()
                    want = got if want is None else want
                    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
                times[label].append(timer(fns("dynamic", plan), replays=30))
        times["static"].append(timer(fns("static", None), replays=30))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return {"case": name, "cut": cut, "us": med, "rounds": times}


def markdown(rows: list[dict], device: str) -> str:
    out = [f"# probe_whole_cut\n\nDevice: {device}. CUDA-graph µs per layer (L2-cold, the decode bench's inputs, bf16 "
           "KV or, where the case says fp8, fp8 KV under a bf16 q; the `tl` kernel), median over rounds, the cuts "
           "interleaved. `model` = the default plan (its cut named), `equal` = split_cost 0, `whole` = split_cost "
           "256, `static` = the split-KV ablation.\n",
           "| case | model's cut | model µs | equal µs | whole µs | static µs | equal / model |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        u = r["us"]
        kind = "whole" if r["cut"]["model"]["whole"] else "equal"
        out.append(f"| {r['case']} | {kind} (bucket {r['cut']['model']['bucket']}, {r['cut']['model']['active']} "
                   f"programs) | {u['model']:.1f} | {u['equal']:.1f} | {u['whole']:.1f} | {u['static']:.1f} | "
                   f"{u['equal'] / u['model']:.3f} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default=CASES)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("probe_whole_cut times CUDA graphs: it needs a GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.cases.split(","):
        rows.append(time_case(name.strip(), args.rounds))
        print(json.dumps({k: rows[-1][k] for k in ("case", "us")}), flush=True)
    device = torch.cuda.get_device_name()
    (args.out / "probe_whole_cut.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    (args.out / "probe_whole_cut.md").write_text(markdown(rows, device))
    print(markdown(rows, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
