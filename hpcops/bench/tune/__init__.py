"""`hpcops tune`: the bench harness with a grid of configs. For each scenario of an op's bench suite, a
coordinate search around the heuristic config (space.py), every candidate gated on the suite's reference
and timed with the suite's inputs and the bench's timing (engine.py), kernels compiled ahead in worker
processes (compile.py); a markdown table and JSON per op (report.py), and for MoE the winners as a tuned
table (moe.py: `moe_tuned.json`, `--write` into hpcops/moe/tuned.py)."""

from __future__ import annotations

import importlib

from hpcops.bench.tune.engine import TuneOp, TuneOptions, TuneResult, tune

# op name -> module exposing OP (a TuneOp), or "module:NAME"
OPS: dict[str, str] = {
    "moe": "hpcops.bench.tune.moe",
    "moe-shapes": "hpcops.bench.tune.moe:SHAPES_OP",
    "decode": "hpcops.bench.tune.decode",
    "decode-grid": "hpcops.bench.tune.decode:GRID_OP",
    "rope": "hpcops.bench.tune.rope",
    "prefill": "hpcops.bench.tune.prefill",
    "prefill-gluon": "hpcops.bench.tune.prefill:GLUON_OP",
}


def load_op(spec: str) -> TuneOp:
    """The TuneOp at "module" (its OP) or "module:NAME"."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr or "OP")


def get_op(name: str) -> TuneOp:
    if name not in OPS:
        raise ValueError(f"unknown op {name!r}; choose from {sorted(OPS)}")
    return load_op(OPS[name])


__all__ = ["OPS", "TuneOp", "TuneOptions", "TuneResult", "get_op", "load_op", "tune"]
