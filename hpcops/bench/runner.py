"""Run a suite: build each case, gate it on correctness, time every implementation in one process."""

from __future__ import annotations

import dataclasses
import fnmatch
import gc
import platform
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hpcops.bench import clock, timing
from hpcops.bench.progress import Progress
from hpcops.bench.registry import Case, PeerUnavailable, get_suite


@dataclass
class Row:
    suite: str
    case: str
    impl: str
    ours: bool
    us: float | None
    status: str  # "ok", "check-failed", "unavailable: ...", "error: ..."
    layers: int = 0
    bytes: int = 0
    flops: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    note: str = ""
    timing: str = "graph"  # registry.TIMINGS: how `us` was measured; ratios compare rows timed alike
    sm_mhz: float | None = None  # the median SM clock NVML read while the row was timed (None: not sampled)

    @property
    def gbps(self) -> float | None:
        return self.bytes / (self.us * 1e-6) / 1e9 if self.us and self.bytes else None

    @property
    def tflops(self) -> float | None:
        return self.flops / (self.us * 1e-6) / 1e12 if self.us and self.flops else None


@dataclass
class SuiteResult:
    suite: str
    rows: list[Row]
    machine: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["gbps"], d["tflops"] = r.gbps, r.tflops
            rows.append(d)
        return {"suite": self.suite, "machine": self.machine, "rows": rows}


def machine_info(measure: bool = True) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, gpu_mem_gb=round(p.total_memory / 2**30, 1))
        if measure:
            copy = timing.copy_bandwidth_gbps()
            info["copy_gbps_by_method"] = {k: round(v, 1) for k, v in copy.items()}
            info["copy_gbps"] = round(max(copy.values()), 1)
            info["gemm_tflops_bf16"] = round(timing.gemm_tflops(torch.bfloat16), 1)  # the TFLOP/s ceiling
    return info


def _time_impl(case: Case, impl, inputs: list[Any], replays: int | None = None,
               window: list[tuple[float, float]] | None = None) -> float:
    # per-step work (the decode plan) is timed the same way, one call per layer's inputs in one
    # graph, so launch overhead is amortized alike; the report keeps it out of the ratios
    fns = [impl.prepare(x) for x in inputs]
    kw: dict[str, Any] = {} if window is None else {"window": window}  # the timed part's (start, end), for the clock
    if impl.timing == "kernels":
        return timing.profiler_kernel_time_us(fns, impl.kernel_filter, **kw)
    if replays is not None:
        kw["replays"] = replays
    return timing.graph_time_us(fns, **kw)


def _run_impl(case: Case, impl, inputs: list[Any], gate_ok: bool,
              replays: int | None = None, windows: list[tuple[float, float]] | None = None) -> tuple[str, float | None]:
    """(status, µs) of one implementation: ours is not timed when the case's gate failed; a peer whose
    own check (in its `prepare`) raises AssertionError is reported as check-failed, never ranked. `windows`: the
    timing function appends the (start, end) monotonic seconds of its timed part (the replays, not the preparation
    or the capture) once it succeeded: the SM clock's window (`clock.ClockSampler`)."""
    if impl.ours and not gate_ok:
        return "check-failed", None
    try:
        return "ok", _time_impl(case, impl, inputs, replays, windows)
    except PeerUnavailable as exc:
        return f"unavailable: {exc}", None
    except AssertionError as exc:  # the peer's output disagrees with the reference (or its own asserts fired)
        print(f"\n[check failed] {case.suite}/{case.name} {impl.name}: {exc}", file=sys.stderr)
        return f"check-failed: {exc}"[:300], None
    except Exception as exc:  # keep going: one broken peer must not hide the others
        traceback.print_exc(file=sys.stderr)
        return f"error: {type(exc).__name__}: {exc}"[:300], None


def case_selected(case: str, only: str | None) -> bool:
    """Whether `--only` selects case `case`: no filter, or the name contains one of its comma-separated texts."""
    return only is None or any(text in case for text in only.split(",") if text)


def impl_selected(impl: str, impls: str | None) -> bool:
    """Whether `--impls` selects row `impl`: no filter, or it matches one of the comma-separated names or shell
    patterns ("hpcops-fp8q,hpcops-bf16kv*")."""
    return impls is None or any(fnmatch.fnmatchcase(impl, p) for p in impls.split(",") if p)


def select_impls(cases: list[Case], impls: str | None) -> list[Case]:
    """`cases` with only the rows `impls` selects (`impl_selected`); a case left with none is dropped. The case's
    correctness gate still runs (it checks the default rows' outputs, which the other rows rely on)."""
    if impls is None:
        return cases
    kept = [dataclasses.replace(c, impls=[i for i in c.impls if impl_selected(i.name, impls)]) for c in cases]
    return [c for c in kept if c.impls]


Windows = dict[str, list[tuple[float, float]]]  # an impl's timing windows, (start, end) monotonic seconds


def _run_rounds(case: Case, inputs: list[Any], gate_ok: bool, rounds: int, step: Callable[[str], None],
                windows: Windows | None = None) -> dict[str, tuple[str, float | None, str]]:
    """Every impl of `case` timed `rounds` times, round-robin, the order reversed every other round (a drift of
    the GPU's clocks over a case, e.g. as it heats under long fp8 kernels, then falls on every impl alike instead
    of on the later rows); each timing takes 50 / rounds replays (at least 10), so the case costs about what one
    round of 50 does, plus a graph capture a round. Returns {impl: (status, median µs, the rounds' µs)}; an impl
    that fails is not timed again. `windows`: each impl's timing windows (`_run_impl`) go to windows[impl]."""
    times: dict[str, list[float]] = {impl.name: [] for impl in case.impls}
    status: dict[str, str] = {}
    replays = max(10, 50 // rounds)
    for r in range(rounds):
        for impl in (case.impls if r % 2 == 0 else case.impls[::-1]):
            if status.get(impl.name, "ok") != "ok":
                step(f"{case.name} {impl.name}: {status[impl.name][:40]}")
                continue
            st, us = _run_impl(case, impl, inputs, gate_ok, replays,
                               None if windows is None else windows.setdefault(impl.name, []))
            status[impl.name] = st
            if us is not None:
                times[impl.name].append(us)
            step(f"{case.name} {impl.name} round {r + 1}/{rounds}: " + (f"{us:.1f} us" if us is not None else st[:40]))
    return {name: (status[name], statistics.median(v) if status[name] == "ok" else None,
                   ", ".join(f"{x:.1f}" for x in v)) for name, v in times.items()}


def run_suite(name: str, opts: dict[str, Any] | None = None, *, check: bool = True, only: str | None = None,
              progress: bool = True, machine: dict[str, Any] | None = None,
              on_case: Callable[[SuiteResult], None] | None = None, rounds: int = 1,
              clocks: bool = True, impls: str | None = None) -> SuiteResult:
    """Run every case of suite `name` (those whose name contains `only`, if given; `only` may list several texts
    separated by commas, a case matching any of them: "q4k,q8k"); `impls`: only the rows it names
    (`select_impls`: names or shell patterns, comma-separated).

    `on_case(partial_result)` runs after every case (the CLI rewrites its reports, so a run cut
    short by a time limit keeps what it measured). `rounds` > 1: each case's impls are timed in that many
    interleaved rounds (`_run_rounds`) and a row's µs is their median, its note naming the rounds' values.
    `clocks`: each row's median SM clock over its timings (`Row.sm_mhz`), where NVML is there (`clock.ClockSampler`).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    opts = dict(opts or {})
    if not torch.cuda.is_available():
        raise RuntimeError("hpcops bench times on a CUDA GPU; none is visible (run `hpcops demo` on the CPU)")
    cases = select_impls([c for c in get_suite(name)(opts) if case_selected(c.name, only)], impls)
    machine = machine if machine is not None else machine_info()
    bar = Progress(rounds * sum(len(c.impls) for c in cases), f"bench {name}", enabled=progress)
    sampler = clock.ClockSampler.start() if clocks else None
    try:
        return _run_cases(name, cases, opts, check, rounds, bar, sampler, machine, on_case)
    finally:
        if sampler is not None:
            sampler.stop()
        bar.close()


def _run_cases(name: str, cases: list[Case], opts: dict[str, Any], check: bool, rounds: int, bar: Progress,
               sampler: clock.ClockSampler | None, machine: dict[str, Any],
               on_case: Callable[[SuiteResult], None] | None) -> SuiteResult:
    """`run_suite`'s loop over its selected cases."""
    rows: list[Row] = []
    for case in cases:
        layers = case.layers or opts.get("layers") or timing.layers_for(case.bytes)
        base = dict(suite=name, case=case.name, layers=layers, bytes=case.bytes, flops=case.flops,
                    params=case.params, command=case.command)
        try:
            inputs = [case.make_inputs(i) for i in range(layers)]
        except Exception as exc:  # a case that cannot be built is reported, not fatal
            for impl in case.impls:
                rows.append(Row(impl=impl.name, ours=impl.ours, us=None, status=f"error: inputs: {exc}", **base))
                for _ in range(rounds):
                    bar.step(f"{case.name} {impl.name}: inputs failed")
            continue
        gate_ok = True
        if check and case.check is not None:
            try:
                case.check(inputs[0])
            except AssertionError as exc:
                gate_ok = False
                print(f"\n[check failed] {name}/{case.name}: {exc}", file=sys.stderr)
        windows: Windows | None = {} if sampler is not None else None  # the timed spans, where the clock is read
        timed = _run_rounds(case, inputs, gate_ok, rounds, bar.step, windows) if rounds > 1 else {}
        for impl in case.impls:
            if rounds > 1:
                status, us, values = timed[impl.name]
            else:
                status, us = _run_impl(case, impl, inputs, gate_ok,
                                       windows=None if windows is None else windows.setdefault(impl.name, []))
            mhz = None if windows is None else sampler.window(*windows.get(impl.name, [])).get("mhz_median")
            note = "per-step" if impl.per_step else impl.note
            if rounds > 1 and us is not None:
                note = f"{note} (median of {rounds} interleaved rounds: {values} µs)".lstrip()
            rows.append(Row(impl=impl.name, ours=impl.ours, us=us, status=status, note=note, timing=impl.timing,
                            sm_mhz=mhz if us is not None else None, **base))
            if rounds == 1:
                bar.step(f"{case.name} {impl.name}: " + (f"{us:.1f} us" if us is not None else status[:40]))
        del inputs
        if on_case is not None:
            on_case(SuiteResult(name, list(rows), machine))
        gc.collect()
        torch.cuda.empty_cache()
    return SuiteResult(name, rows, machine)
