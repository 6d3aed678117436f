"""H200 sweep of PrefillConfig for `prefill_attention` (h64/8, head_dim 128, page 64; bf16, fp8 KV).

Modes: `bf16` (bf16 q and KV), `fp8kv` (bf16 q, fp8 KV: what vLLM passes), `fp8q` (fp8 q with
per-token-head scales, fp8 KV). Shapes: the bench suite's batch specs q2k, q4k, q8k, q1ks2k, 2q1ks4k
(inputs from `hpcops.bench.suites.prefill._make_inputs`, 8 layers, CUDA-graph replay through
`hpcops.bench.timing.graph_time_us`, L2-cold).

Search, per mode (one process, ~4 minutes on an H200):
1. screen on --screen-spec (q4k): block_m × num_warps ∈ {128×8, 64×4, 64×8} × block_n ∈ {64, 128} ×
   tma ∈ {on (block_n 64 only: a TMA tile must lie in one 64-token page), off}, num_stages 2; with fp8q
   also pv_fp8, with fp8kv also quant_q and quant_q + pv_fp8 (128×4 is left out: the sm_90 AOT
   compile spills ~0.5 KB of registers there);
2. the 3 best of (1) with num_stages 3 and 4;
3. the 2 best so far with heads_inner=True and with fma_scale=False;
4. the 3 best configs, the heuristic default (prefill_config) and the default with tma=False on every
   shape.
Every timed variant's output (layer 0) is checked against a sampled fp32 reference (the suite's gate);
a compile error, launch error or mismatch is reported and the variant skipped. Kernels of each stage
are compiled first in --jobs worker processes (same inputs, so the same Triton cache entries), then
timed one by one here. Past --budget-s the optional stages (2, 3) are skipped and stage 4 stops early.

Prints the best config per shape and mode against the default (and FlashInfer's time from
bench/results/prefill.json when there) and writes prefill_sweep.{json,md} under --out.

    python scripts/sweep_prefill.py --out bench/results
    python scripts/sweep_prefill.py --smoke --out /tmp/s   # smallest complete run
    python scripts/sweep_prefill.py --dry-run          # list the variants (no GPU needed)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from hpcops.attention.prefill import PrefillConfig, prefill_config
from hpcops.bench.suites import prefill as suite

HQ, HKV = 64, 8
MODES = {"bf16": (False, False), "fp8kv": (True, False), "fp8q": (True, True)}  # (fp8 KV, fp8 q)
SPECS = ("q2k", "q4k", "q8k", "q1ks2k", "2q1ks4k")
TILES = ((128, 8), (64, 4), (64, 8))  # (block_m, num_warps)
TOP_STAGES, TOP_FLAGS, TOP_FINAL = 3, 2, 3


# ---- variants (pure: also runs on the CPU for --dry-run) ------------------------------------------------


def effective(c: PrefillConfig) -> PrefillConfig:
    """tma=None made explicit for the suite's cache (page 64, aligned, back to back): equal kernels, one key."""
    return c if c.tma is not None else dataclasses.replace(c, tma=suite.PAGE % c.block_n == 0)


def default_config(mode: str, spec: str) -> PrefillConfig:
    """The heuristic's config (prefill_config, tma=None) as the launcher resolves it on these inputs."""
    fp8_kv, fp8_q = MODES[mode]
    fp8 = torch.float8_e4m3fn
    return effective(
        prefill_config(
            head_dim=suite.HEAD_DIM,
            group=HQ // HKV,
            max_seqlen_q=max(q for q, _ in suite.parse_batch_spec(spec)),
            q_dtype=fp8 if fp8_q else torch.bfloat16,
            kv_dtype=fp8 if fp8_kv else torch.bfloat16,
        )
    )


SMOKE_LIMIT: int | None = None  # --smoke: screen only this many configs


def screen_variants(mode: str) -> list[PrefillConfig]:
    """Stage 1: tile shape × warps × TMA (× pv_fp8 / quant_q) at num_stages 2."""
    extras = {
        "bf16": [{}],
        "fp8q": [{}, {"pv_fp8": True}],
        "fp8kv": [{}, {"quant_q": True}, {"quant_q": True, "pv_fp8": True}],
    }
    out = []
    for bm, warps in TILES:
        for bn in (64, 128):
            for tma in (True, False) if suite.PAGE % bn == 0 else (False,):
                base = PrefillConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=2, tma=tma)
                out += [dataclasses.replace(base, **e) for e in extras[mode]]
    return out[:SMOKE_LIMIT]


def stage_variants(best: list[PrefillConfig]) -> list[PrefillConfig]:
    """Stage 2: pipeline depth 3 and 4 for the best screened configs."""
    return [dataclasses.replace(c, num_stages=s) for c in best for s in (3, 4) if s != c.num_stages]


def flag_variants(best: list[PrefillConfig]) -> list[PrefillConfig]:
    """Stage 3: tile-major launch order, and the softmax scale outside exp2's FMA."""
    return [dataclasses.replace(c, heads_inner=True) for c in best] + [
        dataclasses.replace(c, fma_scale=False) for c in best
    ]


def final_variants(mode: str, spec: str, best: list[PrefillConfig]) -> list[PrefillConfig]:
    """The default first, the default on the pointer path, then the best screened configs."""
    d = default_config(mode, spec)
    return _unique([d, dataclasses.replace(d, tma=False), *best])


def _unique(cs):
    out = []
    for c in cs:
        if c not in out:
            out.append(c)
    return out


def short(c: PrefillConfig) -> str:
    s = f"m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages} tma={'auto' if c.tma is None else int(c.tma)}"
    for f in ("pv_fp8", "quant_q", "heads_inner"):
        if getattr(c, f):
            s += f" {f}"
    if not c.fma_scale:
        s += " no-fma"
    return s


# ---- GPU side -------------------------------------------------------------------------------------------

_INPUTS: dict = {}


def inputs_for(spec: str, fp8_kv: bool, layers: int) -> list[dict]:
    key = (spec, fp8_kv, layers)
    if key not in _INPUTS:
        _INPUTS.clear()
        torch.cuda.empty_cache()
        s = suite.Scenario(spec, HQ, HKV, fp8_kv)
        _INPUTS[key] = [suite._make_inputs(s, i) for i in range(layers)]
    return _INPUTS[key]


def make_fn(x: dict, mode: str, config: PrefillConfig):
    from hpcops.attention.prefill import prefill_attention

    kv = x["kv"]
    fp8_q = MODES[mode][1]
    q, q_scale = (x["q8"], x["q_scale"]) if fp8_q else (x["q"], None)
    out = x.setdefault(f"out_{mode}", torch.empty(q.shape, dtype=torch.bfloat16, device=q.device))
    args = (q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens, x["cu"])
    kw = dict(max_seqlen_q=x["max_q"], k_scale=kv.k_scale, v_scale=kv.v_scale, q_scale=q_scale, out=out)
    return lambda: prefill_attention(*args, **kw, config=config)


def _warm(task):
    """Worker: compile (and run once) each config of one (mode, spec) on layer-0 inputs; errors by config."""
    mode, spec, configs = task
    errors = {}
    x = inputs_for(spec, MODES[mode][0], 1)[0]
    for c in configs:
        try:
            make_fn(x, mode, c)()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            errors[c] = f"{type(exc).__name__}: {exc}"[:300]
    return mode, spec, errors


class Sweep:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.records: list[dict] = []
        self.times: dict[tuple, float] = {}  # (mode, spec, config) -> us
        self.errors: dict[tuple, str] = {}
        self.refs: dict[tuple, tuple] = {}
        self.pool = None
        if args.jobs > 1:
            import concurrent.futures as cf
            import multiprocessing as mp

            self.pool = cf.ProcessPoolExecutor(args.jobs, mp_context=mp.get_context("spawn"))

    def elapsed(self) -> float:
        return time.time() - self.t0

    def precompile(self, tasks: dict[tuple, list[PrefillConfig]]) -> None:
        """Warm Triton's cache: compile every (mode, spec) → configs not timed yet in the worker processes.

        Best effort: a worker's error is only counted (the variant is compiled, timed or reported here)."""
        if self.pool is None:
            return
        todo = []
        for (mode, spec), cs in tasks.items():
            cs = [c for c in _unique(cs) if (mode, spec, c) not in self.times and (mode, spec, c) not in self.errors]
            n = max(1, -(-len(cs) // max(1, self.args.jobs)))
            todo += [(mode, spec, cs[i : i + n]) for i in range(0, len(cs), n)]
        if not todo:
            return
        t, failed = time.time(), 0
        try:
            for _, _, errors in self.pool.map(_warm, todo):
                failed += len(errors)
        except Exception as exc:  # noqa: BLE001 - a broken pool only costs compile time here
            print(f"precompile pool failed ({type(exc).__name__}: {exc}); compiling in-process", file=sys.stderr)
            self.pool.shutdown(cancel_futures=True)
            self.pool = None
        n = sum(len(c) for *_, c in todo)
        print(f"  precompiled {n} kernels ({failed} failed) in {time.time() - t:.0f} s", flush=True)

    def reference(self, x: dict, mode: str, config: PrefillConfig, spec: str):
        fp8_q = MODES[mode][1] or (config.quant_q and MODES[mode][0])
        key = (spec, MODES[mode][0], fp8_q)
        if key not in self.refs:
            self.refs[key] = suite._sampled_reference(x, *((x["q8"], x["q_scale"]) if fp8_q else (x["q"], None)))
        return self.refs[key]

    def time(self, mode: str, spec: str, config: PrefillConfig, stage: str) -> float | None:
        from hpcops.bench import timing
        from hpcops.testing import assert_close

        key = (mode, spec, config)
        if key in self.times:
            return self.times[key]
        if key in self.errors:
            return None
        xs = inputs_for(spec, MODES[mode][0], self.args.layers)
        try:
            us = timing.graph_time_us([make_fn(x, mode, config) for x in xs], replays=self.args.replays)
        except Exception as exc:  # noqa: BLE001 - report and keep sweeping
            self.errors[key] = f"{type(exc).__name__}: {exc}"[:300]
            self._record(mode, spec, config, None, "error: " + self.errors[key], stage)
            print(f"  {mode} {spec} {short(config)}: {self.errors[key]}", file=sys.stderr, flush=True)
            return None
        rows, heads, want = self.reference(xs[0], mode, config, spec)
        tol = {"maxtol": 6e-2, "rmstol": 3e-2} if config.pv_fp8 and MODES[mode][0] else {}
        try:
            assert_close(want, xs[0][f"out_{mode}"][rows][:, heads], name=f"{mode} {spec} {short(config)}", **tol)
        except AssertionError as exc:
            self.errors[key] = str(exc)[:300]
            self._record(mode, spec, config, us, "check-failed: " + self.errors[key], stage)
            print(f"  CHECK FAILED {exc}", file=sys.stderr, flush=True)
            return None
        self.times[key] = us
        self._record(mode, spec, config, us, "ok", stage)
        return us

    def _record(self, mode, spec, config, us, status, stage):
        flops = suite.causal_flops(suite.parse_batch_spec(spec), HQ, suite.HEAD_DIM)
        self.records.append(
            dict(
                mode=mode,
                spec=spec,
                stage=stage,
                config=dataclasses.asdict(config),
                label=short(config),
                default=config == default_config(mode, spec),
                us=us,
                tflops=flops / us / 1e6 if us else None,
                status=status,
            )
        )

    def best(self, mode: str, spec: str, n: int) -> list[PrefillConfig]:
        got = [(us, c) for (m, s, c), us in self.times.items() if m == mode and s == spec]
        return [c for _, c in sorted(got, key=lambda t: t[0])[:n]]


def peer_times(path: Path) -> dict[tuple, float]:
    """FlashInfer µs per (mode, spec) from a bench report, where present."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except Exception:  # noqa: BLE001 - optional
        return {}
    out = {}
    for r in rows:
        if r.get("impl") == "flashinfer" and r.get("us") and r["case"].startswith(f"h{HQ}x{HKV}-"):
            _, kv, spec = r["case"].split("-", 2)
            for mode in ("fp8kv", "fp8q") if kv == "fp8" else ("bf16",):
                out[(mode, spec)] = r["us"]
    return out


def write_report(sw: Sweep, modes, specs, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_sweep.json").write_text(json.dumps(sw.records, indent=1))
    peers = peer_times(Path(sw.args.peers))
    lines = [
        "# prefill sweep (H200, h64/8, d128, page 64)",
        "",
        "µs per layer, median of CUDA-graph replays over 8 L2-cold layers; `fi` = FlashInfer from "
        f"{sw.args.peers} (other run); ratio = fi / best (target ≥ 0.85 at q4k/q8k, ≥ 0.9 for q1ks2k/2q1ks4k).",
        "",
        "| mode | shape | default µs | best µs | best TFLOP/s | best config | best/default | fi µs | fi/best |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for mode in modes:
        for spec in specs:
            d = sw.times.get((mode, spec, default_config(mode, spec)))
            b = sw.best(mode, spec, 1)
            if not b:
                lines.append(f"| {mode} | {spec} | {d or '—'} | — | | (nothing ran) | | | |")
                continue
            bu = sw.times[(mode, spec, b[0])]
            flops = suite.causal_flops(suite.parse_batch_spec(spec), HQ, suite.HEAD_DIM)
            fi = peers.get((mode, spec))
            lines.append(
                f"| {mode} | {spec} | {f'{d:.1f}' if d else '—'} | {bu:.1f} | {flops / bu / 1e6:.0f} | {short(b[0])} | "
                f"{f'{bu / d:.2f}' if d else ''} | {f'{fi:.1f}' if fi else ''} | {f'{fi / bu:.2f}' if fi else ''} |"
            )
    lines += [
        "",
        "## every variant",
        "",
        "| mode | shape | stage | config | µs | TFLOP/s | status |",
        "|---|---|---|---|---:|---:|---|",
    ]
    for r in sw.records:
        us = f"{r['us']:.1f}" if r["us"] else ""
        tf = f"{r['tflops']:.0f}" if r["tflops"] else ""
        status = r["status"].replace("|", "/").replace("\n", " ")[:160]
        label = r["label"] + (" (default)" if r["default"] else "")
        lines.append(f"| {r['mode']} | {r['spec']} | {r['stage']} | {label} | {us} | {tf} | {status} |")
    (out / "prefill_sweep.md").write_text("\n".join(lines) + "\n")


def dry_run(modes, specs, screen) -> int:
    total = 0
    for mode in modes:
        vs = screen_variants(mode)
        total += len(vs)
        print(f"[{mode}] stage 1 on {screen}: {len(vs)} variants")
        for c in vs:
            print("   ", short(c))
        print(f"[{mode}] stage 2: num_stages 3, 4 for the best {TOP_STAGES}: {2 * TOP_STAGES} variants, e.g.")
        for c in stage_variants(vs[:1]):
            print("   ", short(c))
        print(f"[{mode}] stage 3: heads_inner / fma_scale=False for the best {TOP_FLAGS}: {2 * TOP_FLAGS} variants")
        for spec in specs:
            fv = final_variants(mode, spec, vs[:TOP_FINAL])
            print(f"[{mode}] stage 4 on {spec}: {len(fv)} variants (default {short(fv[0])}, its tma=0, best 3)")
        total += 2 * TOP_STAGES + 2 * TOP_FLAGS + len(specs) * (TOP_FINAL + 2)
    print(f"at most ~{total} timed variants")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--screen-spec", default="q4k")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument(
        "--jobs",
        type=int,
        default=min(8, max(1, (os.cpu_count() or 2) // 2)),
        help="worker processes that compile each stage's kernels first (1: compile while timing)",
    )
    ap.add_argument("--budget-s", type=float, default=225.0, help="skip optional stages past this wall time")
    ap.add_argument("--peers", default="bench/results/prefill.json", help="bench report with FlashInfer times")
    ap.add_argument("--dry-run", action="store_true", help="list the variants and exit (no GPU)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest complete run: bf16, q2k, the default and two screened configs, 2 layers")
    args = ap.parse_args()
    if args.smoke:
        global SMOKE_LIMIT
        args.modes, args.specs, args.screen_spec, args.layers, args.budget_s = "bf16", "q2k", "q2k", 2, 0.0
        SMOKE_LIMIT = 2
    modes = [m for m in args.modes.split(",") if m]
    specs = [s for s in args.specs.split(",") if s]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; choose from {list(MODES)}")
    for s in specs:
        suite.parse_batch_spec(s)
    if args.screen_spec not in specs:
        specs.insert(0, args.screen_spec)
    if args.dry_run:
        return dry_run(modes, specs, args.screen_spec)
    if not torch.cuda.is_available():
        print("sweep_prefill times on a CUDA GPU; none is visible (use --dry-run)", file=sys.stderr)
        return 2

    sw = Sweep(args)
    out = Path(args.out)
    scr = args.screen_spec
    try:
        # 1. screen
        sw.precompile({(m, scr): screen_variants(m) + [default_config(m, scr)] for m in modes})
        for m in modes:
            for c in [default_config(m, scr), *screen_variants(m)]:
                sw.time(m, scr, c, "screen")
            print(
                f"[{m}] {scr} screen best: "
                + ", ".join(f"{short(c)} {sw.times[(m, scr, c)]:.1f}" for c in sw.best(m, scr, 3)),
                flush=True,
            )
        # 2. pipeline depth, 3. flags (optional: skipped past ~55% of the budget)
        for stage, make, top in (("stages", stage_variants, TOP_STAGES), ("flags", flag_variants, TOP_FLAGS)):
            if sw.elapsed() > 0.55 * args.budget_s:
                print(f"skipping stage {stage}: {sw.elapsed():.0f} s elapsed", flush=True)
                continue
            todo = {(m, scr): make(sw.best(m, scr, top)) for m in modes}
            sw.precompile(todo)
            for (m, _), cs in todo.items():
                for c in cs:
                    sw.time(m, scr, c, stage)
        # 4. every shape
        todo = {(m, s): final_variants(m, s, sw.best(m, scr, TOP_FINAL)) for m in modes for s in specs}
        sw.precompile(todo)
        for (m, s), cs in sorted(todo.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for c in cs:
                if sw.elapsed() > args.budget_s + 30 and c != cs[0]:
                    break  # over budget: only the default per shape from here on
                sw.time(m, s, c, "final")
            d = sw.times.get((m, s, cs[0]))
            b = sw.best(m, s, 1)
            if b:
                bu = sw.times[(m, s, b[0])]
                print(
                    f"{m:6s} {s:8s} default {d or float('nan'):7.1f} us | best {bu:7.1f} us ({short(b[0])})", flush=True
                )
    finally:
        if sw.pool is not None:
            sw.pool.shutdown(cancel_futures=True)
        write_report(sw, modes, specs, out)
        print(f"wrote {out / 'prefill_sweep.md'} ({len(sw.records)} rows) in {sw.elapsed():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
