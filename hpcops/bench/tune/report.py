"""Reports of a tune: `<op>_tune.md` (a table per scenario, for people) and `<op>_tune.json` (every row)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcops.bench.tune.engine import Row, ScenarioResult, TuneResult

TIMING_TEXT = {
    "graph": "CUDA-graph replay of every layer's call, median, per layer (the bench's `hpcops` rows)",
    "kernels": "the device time all the candidate's kernels cover per call (an overlap once), torch.profiler, "
               "median (the bench's `hpcops-kernels` rows)",
}


def _us(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f}"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _rows_in_order(res: ScenarioResult) -> list[Row]:
    rest = sorted(res.rows[1:], key=lambda r: (r.us is None, r.us or 0.0))
    return [res.heuristic, *rest] if res.rows else []


def markdown(result: TuneResult, *, command: str = "", entries: dict[str, str] | None = None,
             summary_only: bool = False) -> str:
    """`entries`: scenario name → what went into the tuned table for it (ops with a table);
    `summary_only`: one line per scenario, without the candidates' tables."""
    m = result.machine
    lines = [f"# hpcops tune {result.op}", "",
             f"Device: {result.device}, torch {m.get('torch', '?')}, triton {m.get('triton', '?')}; "
             f"{result.elapsed_s:.0f} s" + (f"; `{command}`" if command else "") + ".",
             f"Each candidate is a full config; its layer-0 output is checked against the suite's torch reference "
             f"first (a failing candidate is reported, never ranked), then timed on the bench's inputs (each layer "
             f"its own, L2-cold): {TIMING_TEXT.get(result.timing, result.timing)}. Candidates are named by the "
             "fields that differ from the heuristic. `speed-up` = heuristic µs / candidate µs (> 1: faster). "
             "The heuristic and the best candidates are re-timed interleaved at the end; `median µs` is the "
             f"median of all a row's times, and a winner must beat the heuristic by {100 * result.margin:.0f} % "
             "there.", ""]
    if result.aborted:
        lines += [f"**Stopped early**: {result.aborted}", ""]
    head = "| scenario | heuristic µs | best µs | speed-up | best candidate | candidates |"
    sep = "|---|---:|---:|---:|---|---:|"
    if entries is not None:
        head, sep = head + " tuned table |", sep + "---|"
    lines += ["## Summary", "", head, sep]
    for res in result.scenarios:
        if not res.rows:
            lines.append(f"| {res.name} | — | — | | {_cell(res.note)} | 0 |" + (" |" if entries is not None else ""))
            continue
        best = res.best
        sp = f"{res.speedup:.3f}" if res.speedup else ""
        name = "" if best is None else (f"**{best.label}**" if res.winner else best.label)
        timed = sum(r.us is not None for r in res.rows)
        line = (f"| {res.name} | {_us(res.heuristic.median_us)} | {_us(best.median_us if best else None)} | {sp} | "
                f"{_cell(name)}{' (' + _cell(res.note) + ')' if res.note else ''} | {timed}/{len(res.rows)} |")
        if entries is not None:
            line += f" {entries.get(res.name, '')} |"
        lines.append(line)
    for res in result.scenarios if not summary_only else ():
        if not res.rows:
            continue
        base = " ".join(f"{k}={v}" for k, v in res.base.items())
        lines += ["", f"## {res.name}", "", f"heuristic: `{base}`; layers: {res.layers}", "",
                  "| phase | candidate | µs | speed-up | median µs | status |", "|---|---|---:|---:|---:|---|"]
        h = res.heuristic.us
        for r in _rows_in_order(res):
            sp = f"{h / r.us:.3f}" if h and r.us else ""
            med = _us(r.median_us) if r.final else ""
            name = f"**{r.label}**" if r is res.best and res.winner else r.label
            lines.append(f"| {r.phase} | {_cell(name)} | {_us(r.us)} | {sp} | {med} | {_cell(r.status[:160])} |")
    return "\n".join(lines) + "\n"


def to_json(result: TuneResult) -> dict[str, Any]:
    def row(r: Row) -> dict[str, Any]:
        return {"label": r.label, "phase": r.phase, "config": r.config, "status": r.status, "us": r.us,
                "final_us": r.final, "median_us": r.median_us}

    return {"op": result.op, "device": result.device, "timing": result.timing, "margin": result.margin,
            "elapsed_s": round(result.elapsed_s, 1), "aborted": result.aborted, "machine": result.machine,
            "scenarios": [{"name": s.name, "params": s.params, "layers": s.layers, "base": s.base, "note": s.note,
                           "winner": s.winner, "best": s.best.label if s.best else None,
                           "heuristic_us": s.heuristic.median_us if s.rows else None,
                           "best_us": s.best.median_us if s.best else None, "speedup": s.speedup,
                           "rows": [row(r) for r in s.rows]} for s in result.scenarios]}


def write(result: TuneResult, out_dir: str | Path, *, command: str = "",
          entries: dict[str, str] | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{result.op}_tune.md", out / f"{result.op}_tune.json"
    md.write_text(markdown(result, command=command, entries=entries))
    js.write_text(json.dumps(to_json(result), indent=1, default=str) + "\n")
    return [md, js]
