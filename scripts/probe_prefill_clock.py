"""Probe: the SM clock while issue 12's fp8-q and bf16 prefill rows are timed (does bf16 run slower clocks?).

Issue 12's fp8 goal is a ratio of two of our own rows, fp8 q over fp8 KV (`hpcops-fp8q`) against our bf16 default
over bf16 KV (`hpcops-bf16kv`), timed in the same case. At h64/8 the ratio is ~1.40, at h8/1 ~1.20 (H100, sessions
68-69). Per unit of work the bf16 kernel is ~6 % faster at h8/1 than at h64/8, the fp8 kernel ~4 % slower: one
reading is that the long bf16 h64/8 rows (a 16 ms graph replayed 50 times) run at lower SM clocks (power), which
would put part of h64/8's ratio in the clock, not the kernels. This times the two rows of each case exactly as the
bench does (`graph_time_us` over the bench's layer count, L2-cold) while a thread samples NVML every few ms: the
median and lowest SM clock, the mean power and the throttle reasons seen in each row's window, and the time in
clock cycles (µs x median MHz), the ratio a fixed clock would give.

    python3 scripts/probe_prefill_clock.py --out DIR [--cases "h64/8 q4k,h8/1 q4k"] [--rounds 2]

Needs NVML (`pynvml`, from the nvidia-ml-py wheel: carry it in .whl). Writes probe_prefill_clock.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout

import torch  # noqa: E402

from hpcops.bench.clock import ClockSampler  # noqa: E402
from hpcops.bench.suites.prefill import Scenario, _make_inputs, _ours, _ours_bf16_kv  # noqa: E402
from hpcops.bench.timing import graph_time_us, layers_for  # noqa: E402

ROWS = (("hpcops-fp8q", _ours(True)), ("hpcops-bf16kv", _ours_bf16_kv))


def parse_case(text: str) -> Scenario:
    heads, spec = text.split()
    hq, hkv = (int(v) for v in heads.lstrip("h").split("/"))
    return Scenario(spec, hq, hkv, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="h64/8 q4k,h64/8 q8k,h8/1 q4k,h8/1 q8k")
    ap.add_argument("--rounds", type=int, default=2, help="the two rows of a case alternate this many times")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    clock = ClockSampler.start()
    if clock is None:
        raise SystemExit("no GPU, or no NVML (pip install nvidia-ml-py; on the device carry its wheel in .whl)")
    try:
        for text in args.cases.split(","):
            s = parse_case(text.strip())
            layers = [_make_inputs(s, i) for i in range(layers_for(s.bytes))]
            runs = {name: [prepare(x) for x in layers] for name, prepare in ROWS}
            for r in range(args.rounds):
                for name, fns in runs.items():
                    time.sleep(0.5)  # a pause between rows: each starts from the same idle state
                    win = []  # the timed replays' span (not the capture)
                    us = graph_time_us(fns, replays=args.replays, window=win)
                    row = {"case": text.strip(), "impl": name, "round": r, "us": us, "layers": len(fns),
                           **clock.window(*win)}
                    row["mcycles"] = us * row.get("mhz_median", float("nan")) / 1e6 * 1e3  # k-cycles a layer
                    results.append(row)
                    print(json.dumps(row), flush=True)
            del layers, runs
            torch.cuda.empty_cache()
    finally:
        clock.stop()
    (out / "probe_prefill_clock.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                              "rows": results}, indent=1))
    lines = [f"# Prefill rows and the SM clock ({torch.cuda.get_device_name()})", "",
             "`python3 scripts/probe_prefill_clock.py` (issue 12): each row timed as the bench times it, NVML sampled "
             "every ~2 ms during its timed replays; k-cycles = µs x median SM MHz / 1000 (a layer).", "",
             "| case | impl | round | µs | SM MHz median | min | max | W mean | reasons | k-cycles |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in results:
        lines.append(f"| {r['case']} | {r['impl']} | {r['round']} | {r['us']:.1f} | {r.get('mhz_median', '')} | "
                     f"{r.get('mhz_min', '')} | {r.get('mhz_max', '')} | {r.get('watts_mean', 0):.0f} | "
                     f"{r.get('reasons', '')} | {r['mcycles']:.1f} |")
    lines += ["", "| case | fp8q / bf16 ratio in µs | in cycles |", "|---|---:|---:|"]
    for text in args.cases.split(","):
        rows = [r for r in results if r["case"] == text.strip()]
        med = {k: (statistics.median(r["us"] for r in rows if r["impl"] == k),
                   statistics.median(r["mcycles"] for r in rows if r["impl"] == k)) for k, _ in ROWS}
        f, b = med["hpcops-fp8q"], med["hpcops-bf16kv"]
        lines.append(f"| {text.strip()} | {b[0] / f[0]:.3f} | {b[1] / f[1]:.3f} |")
    (out / "probe_prefill_clock.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
