"""The benchmark registry: suites yield cases; a case names its inputs, its byte/FLOP counts,
a correctness check, and the implementations (ours first, then peers) timed side by side."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# suite name -> module under hpcops.bench.suites exposing `cases(opts) -> Iterator[Case]`
SUITES: dict[str, str] = {
    "decode": "hpcops.bench.suites.decode",
    "moe": "hpcops.bench.suites.moe",
    "rope": "hpcops.bench.suites.rope",
    "prefill": "hpcops.bench.suites.prefill",
}


class PeerUnavailable(RuntimeError):
    """A peer implementation cannot run here (not installed, unsupported shape); the row says why."""


@dataclass
class Impl:
    """One implementation of a case.

    `prepare(inputs)` runs outside the timed graph (host-side planning, allocation) and returns a
    zero-argument callable that launches the per-layer work on `inputs`; it must be capturable in
    a CUDA graph. `ours` marks an hpcops implementation (the first is the one ratios are computed
    for). `per_step` work (the decode plan) runs once per model step: it is timed eagerly, alone.
    """

    name: str
    prepare: Callable[[Any], Callable[[], Any]]
    ours: bool = False
    note: str = ""
    per_step: bool = False


@dataclass
class Case:
    """A benchmark scenario.

    `make_inputs(layer, device="cuda")` builds one layer's inputs (each layer its own, so L2 stays
    cold; `device="cpu"` for tools that record launches without a GPU);
    `check(inputs)` raises AssertionError if our output disagrees with the reference (the gate);
    `bytes`/`flops` are the minimum traffic/work of one layer, for GB/s and TFLOP/s.
    `per_step` impls (e.g. the decode plan) are timed once per step, not per layer.
    """

    suite: str
    name: str
    make_inputs: Callable[[int], Any]
    impls: list[Impl]
    check: Callable[[Any], None] | None = None
    bytes: int = 0
    flops: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    layers: int | None = None
    command: str = ""


def get_suite(name: str) -> Callable[[dict], Iterator[Case]]:
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; choose from {sorted(SUITES)}")
    module = importlib.import_module(SUITES[name])
    return module.cases
