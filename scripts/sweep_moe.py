"""H200 sweep of the fused-MoE tile config (`MoeConfig`) on the Hy3 fp8 per-tensor layers of `hpcops bench moe`.

Scenarios: TP8 (E 192, k 8, H 4096, I 192) B = 4, 16, 64, 512, 2048 and EP8 (24 local of 192, I 1536)
B = 4, 64, 512, inputs from the bench suite's builders (static activation scales, shared output, each
layer its own weights: L2-cold). Every variant is timed in this one process with
`hpcops.bench.timing.graph_time_us` (CUDA-graph replay over the layers) after its layer-0 output is
checked against the torch reference (a wrong variant is reported, never ranked).

The grid is a staged (coordinate) search around the heuristic config, per scenario:
  A1  gate-up block_n
  A2  around the best of A1: block_m, block_k, num_stages, num_warps, prequant_x
  B1  down GEMM: down_block_n × down_block_k
  B2  down_num_warps × down_num_stages around the best of B1
Kernels of a stage are compiled first by `--jobs` worker processes (Triton's disk cache is shared), so
compilation does not serialize; a variant that fails to compile is reported and skipped. `--budget-s`
stops starting new variants (default 225 s: the whole run fits in ~4 minutes on an H200).

    python scripts/sweep_moe.py --out bench/results            # on the GPU
    python scripts/sweep_moe.py --dry-run                      # lists the variants (CPU is fine)
    HPCOPS_MOE_TUNED=bench/results/moe_sweep.json hpcops bench moe --only B4-tp8-fp8t   # try the result

Writes OUT/moe_sweep.json ({"device", "entries": [tuned-table entries], "scenarios": [...]}) and
OUT/moe_sweep.md. The "entries" list is what `hpcops/moe/tuned.py` holds per device.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, also in the spawned workers

SCENARIOS = [("tp8", 4), ("tp8", 16), ("tp8", 64), ("tp8", 512), ("tp8", 2048), ("ep8", 4), ("ep8", 64), ("ep8", 512)]
KIND = "fp8_tensor"


# ---- variants ------------------------------------------------------------------------------------

def _scenario(layout: str, t: int):
    from hpcops.bench.suites import moe as suite

    return suite.Scenario(layout, t, KIND)


def _avg(s) -> float:
    from hpcops.bench.suites import moe as suite

    return s.t * suite.TOP_K / suite.E_GLOBAL


def base_config(s) -> dict:
    """The untuned heuristic's tunable fields for scenario `s` (what `get_config` gives without a table)."""
    from hpcops.bench.suites import moe as suite
    from hpcops.moe.configs import TUNABLE, heuristic_config

    cfg = heuristic_config(num_tokens=s.t, top_k=suite.TOP_K, num_experts=suite.E_GLOBAL, hidden=suite.HIDDEN,
                           inter=s.inter, quant=KIND)
    return {k: getattr(cfg, k) for k in TUNABLE}


def _key(v: dict) -> str:
    return json.dumps(v, sort_keys=True)


def _valid(s, v: dict) -> bool:
    return v["down_block_k"] <= max(64, s.inter) and v["block_n"] <= max(32, s.inter)


def _uniq(s, variants: list[dict], seen: set[str] | None = None) -> list[dict]:
    out, keys = [], set(seen or ())
    for v in variants:
        k = _key(v)
        if k not in keys and _valid(s, v):
            keys.add(k)
            out.append(v)
    return out


def stage_a1(s, base: dict) -> list[dict]:
    bns = (16, 32, 64) if _avg(s) <= 4 else (32, 64, 128)
    return _uniq(s, [base] + [dict(base, block_n=bn) for bn in bns])


def stage_a2(s, best: dict) -> list[dict]:
    bm = best["block_m"]
    out = [dict(best, block_m=m) for m in (bm // 2, bm * 2) if 16 <= m <= 128 and not (m > 16 and _avg(s) <= 1)]
    out += [dict(best, block_k=bk) for bk in (64, 128, 256) if bk != best["block_k"]]
    out += [dict(best, num_stages=st) for st in (best["num_stages"] - 1, best["num_stages"] + 1) if 2 <= st <= 5]
    out.append(dict(best, num_warps=8 if best["num_warps"] == 4 else 4))
    if s.t >= 64:
        out.append(dict(best, prequant_x=not best["prequant_x"]))
    return out


def stage_b1(s, best: dict) -> list[dict]:
    bks = [bk for bk in (64, 128, 256) if bk <= max(64, s.inter)]
    return [dict(best, down_block_n=bn, down_block_k=bk) for bn in (32, 64, 128) for bk in bks]


def stage_b2(s, best: dict) -> list[dict]:
    return [dict(best, down_num_warps=w, down_num_stages=st) for w in (4, 8) for st in (2, 3, 4, 5)
            if (w, st) != (best["down_num_warps"], best["down_num_stages"]) and (st >= 3 or w == 4)]


STAGES = [("A1", None), ("A2", stage_a2), ("B1", stage_b1), ("B2", stage_b2)]


# ---- compile workers -----------------------------------------------------------------------------

_WORKER_INPUTS: dict = {}


def _worker_run(layout: str, t: int, variant: dict) -> str | None:
    """In a worker process: build layer-0 inputs once per scenario and run the variant once (compiles it)."""
    import torch

    from hpcops.bench.suites import moe as suite

    s = _scenario(layout, t)
    try:
        if (layout, t) not in _WORKER_INPUTS:
            while len(_WORKER_INPUTS) >= 2:  # keep two scenarios' layer-0 inputs (< 2 GB)
                _WORKER_INPUTS.pop(next(iter(_WORKER_INPUTS)))
            torch.cuda.empty_cache()
            _WORKER_INPUTS[(layout, t)] = suite._make_inputs(s, 0)
        suite._ours(s, variant)(_WORKER_INPUTS[(layout, t)])()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


class Warmer:
    """Compiles variants in `jobs` spawned processes (the parent then loads them from Triton's disk cache)."""

    def __init__(self, jobs: int):
        self.jobs = jobs
        self.pool = None
        if jobs > 0:
            self._start()

    def _start(self):
        self.pool = ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("spawn"))

    def _batch(self, items) -> dict[tuple[str, str], str]:
        futs = [(s, v, self.pool.submit(_worker_run, s.layout, s.t, v)) for s, v in items]
        errors = {}
        for s, v, f in futs:
            err = f.result(timeout=300)
            if err:
                errors[(s.name, _key(v))] = err
        return errors

    def warm(self, items: list[tuple[object, dict]]) -> dict[tuple[str, str], str]:
        """{(scenario name, variant key): error} for the variants that failed in a worker. Variants that
        fail there are never run in this process (a faulting kernel would end the sweep)."""
        if self.pool is None or not items:
            return {}
        try:
            errors = self._batch(items)
            if any("CUDA error" in e for e in errors.values()):
                # a kernel fault poisons its worker's context: later variants on that worker fail too;
                # retry the failures once on fresh workers
                self.close()
                self._start()
                retry = [(s, v) for s, v in items if (s.name, _key(v)) in errors]
                again = self._batch(retry)
                errors = again
                self.close()
                self._start()
            return errors
        except Exception as exc:  # noqa: BLE001 - a broken pool: compile in this process instead
            print(f"[sweep] compile workers failed ({type(exc).__name__}: {exc}); compiling in-process",
                  file=sys.stderr)
            self.close()
            return {}

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None


# ---- timing --------------------------------------------------------------------------------------

class ScenarioRun:
    def __init__(self, layout: str, t: int, layers: int | None, replays: int):
        import torch

        from hpcops.bench import timing
        from hpcops.bench.suites import moe as suite

        self.s = s = _scenario(layout, t)
        self.replays = replays
        nbytes, _ = suite._traffic(s)
        self.bytes = nbytes
        n = layers or timing.layers_for(nbytes)
        self.inputs = [suite._make_inputs(s, i) for i in range(n)]
        self.want = suite._reference(s, self.inputs[0])
        torch.cuda.synchronize()
        self.rows: dict[str, dict] = {}
        self.default = base_config(s)

    def run(self, variant: dict, stage: str, error: str | None = None) -> dict:
        import torch

        from hpcops.bench import timing
        from hpcops.bench.suites import moe as suite
        from hpcops.testing import assert_close

        k = _key(variant)
        if k in self.rows:
            return self.rows[k]
        row = {"stage": stage, "config": variant, "us": None, "status": "ok"}
        self.rows[k] = row
        if error is not None:
            row["status"] = f"compile/run error: {error}"
            return row
        try:
            fns = [suite._ours(self.s, variant)(x) for x in self.inputs]
            got = fns[0]()
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            return row
        try:
            assert_close(self.want, got, name="sweep", maxtol=5e-2, rmstol=2e-2)  # fp8 tolerance of the suite
        except AssertionError as exc:
            row["status"] = f"wrong: {str(exc)[:200]}"
            return row
        try:
            row["us"] = timing.graph_time_us(fns, replays=self.replays)
            row["gbps"] = self.bytes / row["us"] / 1e3
        except Exception as exc:  # noqa: BLE001
            row["status"] = f"error (timing): {type(exc).__name__}: {str(exc)[:300]}"
        return row

    def best(self) -> dict | None:
        ok = [r for r in self.rows.values() if r["us"] is not None]
        return min(ok, key=lambda r: r["us"]) if ok else None


def _diff(v: dict, base: dict) -> str:
    d = {k: x for k, x in v.items() if base.get(k) != x}
    return ",".join(f"{k}={int(x) if isinstance(x, bool) else x}" for k, x in d.items()) or "(default)"


# ---- main ----------------------------------------------------------------------------------------

def dry_run(scenarios) -> int:
    total = 0
    for layout, t in scenarios:
        s = _scenario(layout, t)
        base = base_config(s)
        a1 = stage_a1(s, base)
        print(f"{s.name}: default {_diff(base, {})}")
        print(f"  A1 ({len(a1)}): " + "; ".join(_diff(v, base) for v in a1))
        for name, fn in STAGES[1:]:
            vs = _uniq(s, fn(s, base), {_key(v) for v in a1})
            print(f"  {name} around the best so far, e.g. around the default ({len(vs)}): "
                  + "; ".join(_diff(v, base) for v in vs))
            total += len(vs)
        total += len(a1)
    print(f"about {total} variants (fewer where stages coincide)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--only", default=None, help="substring of the scenario names (e.g. B4-tp8)")
    ap.add_argument("--dry-run", action="store_true", help="list the variants and exit (no GPU needed)")
    ap.add_argument("--jobs", type=int, default=8, help="compile worker processes (0: compile in-process)")
    ap.add_argument("--budget-s", type=float, default=225.0, help="stop starting variants after this long")
    ap.add_argument("--layers", type=int, default=None, help="layers per graph (default: the suite's L2-cold rule)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--smoke", action="store_true",
                    help="smallest complete run: the first matching scenario, stage A1 only, 2 layers")
    args = ap.parse_args()
    scenarios = [(lay, t) for lay, t in SCENARIOS if args.only is None or args.only in _scenario(lay, t).name]
    if not scenarios:
        ap.error(f"--only {args.only!r} matches no scenario of {[_scenario(*sc).name for sc in SCENARIOS]}")
    if args.smoke:
        scenarios, args.layers, args.replays = scenarios[:1], args.layers or 2, min(args.replays, 10)
    if args.dry_run:
        return dry_run(scenarios)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("sweep_moe: needs a CUDA GPU (use --dry-run to list the variants)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    warmer = Warmer(args.jobs)
    # stage A1 of every scenario compiles up front in the workers, in one batch
    base_of = {sc: base_config(_scenario(*sc)) for sc in scenarios}
    a1_of = {sc: stage_a1(_scenario(*sc), base_of[sc]) for sc in scenarios}
    errors = warmer.warm([(_scenario(*sc), v) for sc in scenarios for v in a1_of[sc]])
    print(f"[sweep] stage A1 compiled in {time.monotonic() - t0:.0f} s ({len(errors)} failures)", flush=True)
    from hpcops.bench import timing

    copy = timing.copy_bandwidth_gbps(1 << 30)  # also lifts an idle GPU out of its low clocks
    print(f"[sweep] {device}: copy bandwidth " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in copy.items()),
          flush=True)
    results, entries, skipped = [], [], 0
    for sc in scenarios:
        s = _scenario(*sc)
        if time.monotonic() - t0 > args.budget_s:
            print(f"[sweep] budget spent: {s.name} skipped", file=sys.stderr)
            skipped += 1
            continue
        run = ScenarioRun(*sc, args.layers, args.replays)
        for v in a1_of[sc]:
            run.run(v, "A1", errors.get((s.name, _key(v))))
        for name, fn in STAGES[1:] if not args.smoke else ():
            if time.monotonic() - t0 > args.budget_s:
                print(f"[sweep] budget spent: {s.name} stops before {name}", file=sys.stderr)
                break
            best = run.best()
            if best is None:
                break
            vs = _uniq(s, fn(s, best["config"]), set(run.rows))
            errs = warmer.warm([(s, v) for v in vs])
            for v in vs:
                run.run(v, name, errs.get((s.name, _key(v))))
        best = run.best()
        default_row = run.rows.get(_key(run.default))
        d_us = default_row["us"] if default_row else None
        rows = sorted(run.rows.values(), key=lambda r: (r["us"] is None, r["us"] or 0.0))
        results.append({"case": s.name, "layout": s.layout, "T": s.t, "default": run.default, "default_us": d_us,
                        "best": best, "rows": rows})
        if best is not None:
            from hpcops.bench.suites import moe as suite

            entries.append({"E": suite.E_GLOBAL, "E_local": s.n_local, "H": suite.HIDDEN, "I": s.inter,
                            "quant": KIND, "T": s.t, "config": best["config"], "us": round(best["us"], 1),
                            "default_us": None if d_us is None else round(d_us, 1)})
            print(f"{s.name:14s} best {best['us']:7.1f} us  [{_diff(best['config'], run.default)}]"
                  f"  | default {d_us if d_us is None else round(d_us, 1)} us | {len(run.rows)} variants, "
                  f"{sum(r['us'] is None for r in rows)} failed", flush=True)
        else:
            print(f"{s.name:14s} no variant ran", flush=True)
        del run
        torch.cuda.empty_cache()
        _write(out_dir, device, torch.__version__, triton.__version__, results, entries, time.monotonic() - t0)
    warmer.close()
    print(f"[sweep] {time.monotonic() - t0:.0f} s; wrote {out_dir}/moe_sweep.json and moe_sweep.md"
          + (f"; {skipped} scenarios skipped (budget)" if skipped else ""))
    return 0


def _write(out_dir: Path, device: str, torch_v: str, triton_v: str, results: list, entries: list,
           elapsed: float) -> None:
    data = {"device": device, "torch": torch_v, "triton": triton_v, "elapsed_s": round(elapsed, 1),
            "entries": entries, "scenarios": results}
    (out_dir / "moe_sweep.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    lines = ["# fused MoE config sweep (scripts/sweep_moe.py)", "",
             f"Device: {device}, torch {torch_v}, triton {triton_v}; {elapsed:.0f} s. fp8 per-tensor, static "
             "activation scales, CUDA-graph replay over L2-cold layers; µs per layer. Configs are shown as the "
             "fields that differ from the heuristic default.", ""]
    for r in results:
        d_us = "—" if r["default_us"] is None else f"{r['default_us']:.1f} µs"
        lines += [f"## {r['case']}", "", f"default: `{_diff(r['default'], {})}` → {d_us}", "",
                  "| stage | config (vs default) | µs | GB/s | status |", "|---|---|---:|---:|---|"]
        for row in r["rows"][:12] + [x for x in r["rows"][12:] if x["us"] is None]:
            us = "" if row["us"] is None else f"{row['us']:.1f}"
            gb = "" if row["us"] is None else f"{row['gbps']:.0f}"
            lines.append(f"| {row['stage']} | {_diff(row['config'], r['default'])} | {us} | {gb} | "
                         f"{row['status'][:120].replace('|', '/')} |")
        lines.append("")
    (out_dir / "moe_sweep.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

