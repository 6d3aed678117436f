"""The benchmark registry: suites yield cases; a case names its inputs, its byte/FLOP counts,
a correctness check, and the implementations (ours first, then peers) timed side by side."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

# suite name -> module under hpcops.bench.suites exposing `cases(opts) -> Iterator[Case]`
SUITES: dict[str, str] = {
    "decode": "hpcops.bench.suites.decode",
    "decode-grid": "hpcops.bench.suites.decode_grid",  # `hpcops bench decode --grid`; not in 'all'
    "moe": "hpcops.bench.suites.moe",
    "moe-shapes": "hpcops.bench.suites.moe_shapes",
    "rope": "hpcops.bench.suites.rope",
    "prefill": "hpcops.bench.suites.prefill",
    "layer": "hpcops.bench.suites.layer",
    "router": "hpcops.bench.suites.router",
}


# how an implementation is timed (Impl.timing): "graph" = CUDA-graph replay of every layer's call / layers
# (timing.graph_time_us); "kernels" = median per call of the device time its kernels cover (durations summed,
# overlaps once), from torch.profiler (timing.profiler_kernel_time_us). Ratios only compare rows timed the same way.
TIMINGS = ("graph", "kernels")


class PeerUnavailable(RuntimeError):
    """A peer implementation cannot run here (not installed, unsupported shape); the row says why."""


_FLASHINFER_WORKSPACE: dict[str, Any] = {}


def flashinfer_workspace(device) -> Any:
    """The float workspace (512 MiB, one per device) that every FlashInfer wrapper of a run shares: a run's
    layers execute one after another. 128 MiB per layer made FlashInfer's prefill plan fail on h8/1 with
    fp8 KV ("Buffer overflow when allocating memory for batch_prefill_tmp_s")."""
    import torch

    key = str(torch.device(device))
    if key not in _FLASHINFER_WORKSPACE:
        _FLASHINFER_WORKSPACE[key] = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    return _FLASHINFER_WORKSPACE[key]


def peer_dirs() -> list[Path]:
    """Folders searched for vendored peer packages (e.g. `vllm_kernels/`): `$HPCOPS_PEERS_DIR` if set,
    else `.peers/` at the root of the checkout this hpcops package is imported from."""
    env = os.environ.get("HPCOPS_PEERS_DIR")
    if env:
        return [Path(env).expanduser()]
    return [Path(__file__).resolve().parents[2] / ".peers"]  # hpcops/bench/registry.py -> checkout root


def import_vendored(module: str, *, how: str) -> ModuleType:
    """Import `module` (e.g. "vllm_kernels.moe.fused_moe") from a vendored peer tree.

    The first folder of `peer_dirs()` that holds the top-level package goes on `sys.path`; failing that,
    a package already importable (PYTHONPATH) is used. Raises PeerUnavailable, with `how` (the command
    that vendors it), when it is nowhere, or when importing it fails.
    """
    top = module.split(".")[0]
    dirs = peer_dirs()
    found = next((d for d in dirs if (d / top / "__init__.py").is_file()), None)
    if found is not None:
        if str(found) not in sys.path:
            sys.path.insert(0, str(found))
    elif top not in sys.modules and importlib.util.find_spec(top) is None:
        where = ", ".join(str(d / top) for d in dirs)
        raise PeerUnavailable(f"{top} is not vendored (no {where}; HPCOPS_PEERS_DIR overrides the folder): {how}")
    try:
        return importlib.import_module(module)
    except Exception as exc:  # a broken or partial tree: report it on the row, never fail the run
        raise PeerUnavailable(f"importing {module} failed: {type(exc).__name__}: {exc}"[:300]) from exc


@dataclass
class Impl:
    """One implementation of a case.

    `prepare(inputs)` runs outside the timed graph (host-side planning, allocation) and returns a
    zero-argument callable that launches the per-layer work on `inputs`; it must be capturable in
    a CUDA graph. `ours` marks an hpcops implementation (the first is the one ratios are computed
    for). `per_step` work (the decode plan) runs once per model step: it is timed eagerly, alone.
    `timing` (one of TIMINGS): "graph" (default) or "kernels", the profiler's device time of the kernels
    the callable launches, only those whose name contains `kernel_filter` (or one of its texts) if given (a peer
    timed by its own kernels, without the stand-ins around them; our GEMMs alone); such an impl need not be
    capturable.
    """

    name: str
    prepare: Callable[[Any], Callable[[], Any]]
    ours: bool = False
    note: str = ""
    per_step: bool = False
    timing: str = "graph"
    kernel_filter: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.timing not in TIMINGS:
            raise ValueError(f"Impl {self.name!r}: timing must be one of {TIMINGS}, got {self.timing!r}")
        if self.kernel_filter is not None and self.timing != "kernels":
            raise ValueError(f"Impl {self.name!r}: kernel_filter needs timing='kernels'")


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


def suite_finisher(name: str) -> Callable[[Any, Any], tuple[Any, list[Path]]] | None:
    """A suite's optional `finish(result, out_dir) -> (result, extra paths)`: rows derived from the measured
    ones and suite-specific reports (the `layer` suite's baseline total and component table), or None."""
    if name not in SUITES:
        raise ValueError(f"unknown bench suite {name!r}; choose from {sorted(SUITES)}")
    return getattr(importlib.import_module(SUITES[name]), "finish", None)


def suite_hook(name: str, attr: str) -> Callable[..., Any] | None:
    """A registered suite's optional report hook, None for other results (a tuning run, a test's fake suite):
    `summary_markdown(result) -> str` (appended to its markdown) or `plot(result, path) -> bool` (its PNG in
    place of the default bars)."""
    if name not in SUITES:
        return None
    return getattr(importlib.import_module(SUITES[name]), attr, None)
