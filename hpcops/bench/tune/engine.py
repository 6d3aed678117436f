"""The tune loop: per scenario, the bench suite's inputs (every layer its own, L2-cold), each candidate
gated on layer 0 against the suite's reference, then timed with the bench's timing functions; the
heuristic and the best candidates re-timed interleaved at the end, and the winner kept only when it
beats the heuristic by a margin.

Order of work, so that compiles overlap timing: phase A of every scenario compiles in the workers
ahead of its timing (the next scenario's while this one is timed); phase B of scenario i is queued
when its phase A is timed and is timed after phase A of scenario i+1 (two scenarios' inputs live).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpcops.bench import timing
from hpcops.bench.progress import Progress
from hpcops.bench.runner import case_selected
from hpcops.bench.tune.compile import Compiler, is_cuda_fault
from hpcops.bench.tune.space import Candidate, Knob, combinations, key, label, neighbours

MAX_CANDIDATES = 48  # per scenario, phases A + B (the heuristic included)


class TuneOp:
    """One op's tuning: its scenarios (the bench suite's), its search space around the heuristic, and
    how a candidate runs, is gated and is timed. Subclasses fill in the hooks."""

    name = ""
    timing = "graph"  # registry.TIMINGS: "graph" (CUDA-graph replay) or "kernels" (profiler device time)
    space: tuple[Knob, ...] = ()
    has_table = False  # writes a tuned table (`entries`, `write_table`)

    def scenarios(self, quick: bool) -> list[Any]:
        """The bench suite's scenarios (objects with `.name`, picklable: they travel to the workers)."""
        raise NotImplementedError

    def base(self, s: Any) -> Candidate:
        """The heuristic's value of every tuned field for scenario `s`."""
        raise NotImplementedError

    def valid(self, s: Any, cand: Candidate) -> bool:
        """A cheap filter of combinations known to be refused (the op's ValueError is the backstop)."""
        return True

    def extra(self, s: Any, base: Candidate) -> list[Candidate]:
        """Candidates timed right after the heuristic (e.g. the config the current tuned table picks)."""
        return []

    def make_inputs(self, s: Any, layer: int, device: str) -> Any:
        raise NotImplementedError

    def bytes(self, s: Any) -> int:
        raise NotImplementedError

    def params(self, s: Any) -> dict[str, Any]:
        return {}

    def layers(self, s: Any) -> int:
        """Layers timed together, each with its own inputs: the bench's L2-cold count."""
        return timing.layers_for(self.bytes(s))

    def prepare(self, s: Any, cand: Candidate) -> Callable[[Any], Callable[[], Any]]:
        """Like `Impl.prepare`: inputs → a zero-argument callable launching the candidate (capturable)."""
        raise NotImplementedError

    def context(self, cand: Candidate):
        """Entered around a candidate's gate and timing (process-wide knobs); nothing by default."""
        return contextlib.nullcontext()

    def gate(self, s: Any, x: Any, cand: Candidate, name: str) -> None:
        """Run the candidate on layer-0 inputs `x`; AssertionError if it disagrees with the reference."""
        raise NotImplementedError

    # ops with a tuned table (`has_table`)
    def table_notes(self, result: TuneResult) -> dict[str, str] | None:
        """Scenario name → what the tuned table gets from it (a report column); None: no table."""
        return None

    def write_table(self, result: TuneResult, out_dir: str) -> Path | None:
        """Write the winners as a table file under `out_dir`; its path."""
        return None

    def merge_into_table(self, result: TuneResult) -> str:
        """Merge the winners into the package's tuned table; a line saying what changed."""
        raise NotImplementedError(f"{self.name} has no tuned table")


@dataclass
class Limits:
    phase_a: int
    phase_b: int
    final_top: int  # candidates re-timed against the heuristic at the end
    rounds: int  # interleaved re-timing rounds

    @staticmethod
    def of(quick: bool, smoke: bool) -> Limits:
        if smoke:
            return Limits(phase_a=2, phase_b=0, final_top=1, rounds=1)
        if quick:
            return Limits(phase_a=5, phase_b=1, final_top=1, rounds=1)
        return Limits(phase_a=MAX_CANDIDATES - 6, phase_b=6, final_top=2, rounds=2)


@dataclass
class TuneOptions:
    only: str | None = None
    quick: bool = False
    smoke: bool = False
    jobs: int = 0
    budget_s: float | None = 240.0
    timing: str | None = None  # None: the op's
    layers: int | None = None
    margin: float = 0.03
    progress: bool = True


@dataclass
class Row:
    label: str
    phase: str  # "A", "B" or "current" (the config the tuned table picks now)
    config: Candidate
    status: str = "pending"  # "ok", "invalid: ...", "check-failed: ...", "error: ...", "skipped: ..."
    us: float | None = None  # its time in its phase
    final: list[float] = field(default_factory=list)  # interleaved re-timings at the end

    @property
    def times(self) -> list[float]:
        return ([self.us] if self.us is not None else []) + self.final

    @property
    def median_us(self) -> float | None:
        return statistics.median(self.times) if self.times else None


@dataclass
class ScenarioResult:
    name: str
    params: dict[str, Any]
    base: Candidate
    layers: int
    rows: list[Row] = field(default_factory=list)
    best: Row | None = None
    winner: bool = False  # best beats the heuristic by the margin (median of its times)
    note: str = ""

    @property
    def heuristic(self) -> Row:
        return self.rows[0]

    @property
    def measured(self) -> bool:
        """The heuristic and at least one other candidate were timed."""
        return bool(self.rows) and self.heuristic.us is not None and sum(r.us is not None for r in self.rows) >= 2

    @property
    def speedup(self) -> float | None:
        if not self.rows or self.best is None:
            return None
        h, b = self.heuristic.median_us, self.best.median_us
        return h / b if h and b else None


@dataclass
class TuneResult:
    op: str
    timing: str
    margin: float
    device: str
    scenarios: list[ScenarioResult]
    elapsed_s: float = 0.0
    aborted: str = ""
    machine: dict[str, Any] = field(default_factory=dict)


class _Fatal(RuntimeError):
    """A sticky CUDA error in this process: nothing more can run."""


def on_gpu() -> bool:
    from hpcops._platform import is_interpreter

    return torch.cuda.is_available() and not is_interpreter()


def select(op: TuneOp, opts: TuneOptions) -> list[Any]:
    out = [s for s in op.scenarios(opts.quick) if case_selected(s.name, opts.only)]
    return out[:1] if opts.smoke else out


def phase_a(op: TuneOp, s: Any, limits: Limits) -> list[tuple[str, Candidate]]:
    """[(phase, candidate)]: the heuristic, the op's extra candidates, then the one-knob moves."""
    base = op.base(s)
    valid = lambda c: op.valid(s, c)
    out = [("A", base)] + [("current", c) for c in op.extra(s, base) if key(c) != key(base)]
    seen = {key(c) for _, c in out}
    out += [("A", c) for c in neighbours(base, op.space, s, valid)[1:] if key(c) not in seen]
    return out[:limits.phase_a]


class _Scenario:
    """A scenario in flight: its inputs (live from its phase A to its end) and its rows."""

    def __init__(self, op: TuneOp, s: Any, limits: Limits, layers: int | None):
        self.s = s
        self.cands = phase_a(op, s, limits)
        base = self.cands[0][1]
        self.result = ScenarioResult(s.name, op.params(s), base, layers or op.layers(s))
        self.cands_b: list[tuple[str, Candidate]] = []
        self.inputs: list[Any] | None = None
        self.share = 0.0


class Tuner:
    def __init__(self, op: TuneOp, opts: TuneOptions, *, log=sys.stderr):
        self.op, self.opts, self.log = op, opts, log
        self.limits = Limits.of(opts.quick, opts.smoke)
        self.how = opts.timing or op.timing
        self.device = "cuda" if on_gpu() else "cpu"
        self.start = time.monotonic()
        from hpcops.bench.tune import OPS

        self.compiler = Compiler(OPS.get(op.name), opts.jobs if self.device == "cuda" else 0, log=log)
        self.bar: Progress | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    # ---- one candidate

    def _time(self, fns: Sequence[Callable[[], Any]]) -> float:
        if self.how == "kernels":
            return timing.profiler_kernel_time_us(fns)
        return timing.graph_time_us(fns, replays=10 if self.opts.smoke else 50)

    def _run(self, st: _Scenario, cand: Candidate, name: str) -> tuple[str, float | None]:
        """(status, µs): gate on layer 0, then time over every layer."""
        op = self.op
        try:
            with op.context(cand):
                op.gate(st.s, st.inputs[0], cand, name)
                fns = [op.prepare(st.s, cand)(x) for x in st.inputs]
                return "ok", self._time(fns)
        except ValueError as exc:
            return f"invalid: {exc}"[:300], None
        except AssertionError as exc:
            print(f"\n[check failed] {op.name}/{st.s.name} [{name}]: {exc}", file=self.log)
            return f"check-failed: {exc}"[:300], None
        except Exception as exc:  # noqa: BLE001 - one broken candidate must not end the tune
            if is_cuda_fault(exc):
                raise _Fatal(f"{st.s.name} [{name}]: {type(exc).__name__}: {exc}"[:500]) from exc
            return f"error: {type(exc).__name__}: {exc}"[:300], None

    def _measure(self, st: _Scenario, row: Row, skip: bool) -> float:
        """Gate and time one row (unless `skip`: out of time); returns the seconds spent waiting for its
        compile in a worker."""
        waited = 0.0
        if skip:
            row.status = "skipped: time budget"
        else:
            t0 = time.monotonic()
            row.status = self.compiler.status(st.s, row.config) or "pending"
            waited = time.monotonic() - t0
            if row.status == "pending":
                row.status, row.us = self._run(st, row.config, row.label)
        if self.bar is not None:
            what = f"{row.us:.1f} us" if row.us is not None else row.status[:40]
            self.bar.step(f"{st.s.name} {row.label[:40]}: {what}")
        return waited

    # ---- phases

    def _phase(self, st: _Scenario, cands: list[tuple[str, Candidate]], share: float) -> None:
        """Time `cands` (rows in this order), those already compiled first; past `share` seconds (not
        counting the waits for compiles) the rest are skipped, except the heuristic."""
        deadline = None if self.opts.budget_s is None else time.monotonic() + share
        base = st.result.base
        todo = [Row(label(cand, base), phase, cand) for phase, cand in cands]
        st.result.rows += todo
        while todo:
            row = next((r for r in todo if self.compiler.ready(st.s, r.config)), todo[0])
            todo.remove(row)
            late = deadline is not None and time.monotonic() > deadline and row is not st.result.rows[0]
            waited = self._measure(st, row, late)
            if deadline is not None:
                deadline += waited  # a wait for the workers is shared by all scenarios, not charged here

    def _phase_b(self, st: _Scenario) -> list[tuple[str, Candidate]]:
        res = st.result
        h = res.heuristic
        if self.limits.phase_b == 0 or h.us is None:
            return []
        timed = [(r.config, r.us) for r in res.rows[1:] if r.phase == "A" and r.us is not None]
        room = min(self.limits.phase_b, MAX_CANDIDATES - len(res.rows))
        return [("B", c) for c in combinations(res.base, timed, h.us, self.op.space, st.s,
                                               lambda c: self.op.valid(st.s, c), limit=max(room, 0),
                                               seen=[key(r.config) for r in res.rows])]

    def _final(self, st: _Scenario) -> None:
        """Re-time the heuristic and the best candidates interleaved; the best by median wins."""
        res = st.result
        h = res.heuristic
        ok = sorted((r for r in res.rows[1:] if r.us is not None), key=lambda r: r.us)
        top = ok[:self.limits.final_top]
        if h.us is not None and top:
            for _ in range(self.limits.rounds):
                for r in [h, *top]:
                    status, us = self._run(st, r.config, r.label)
                    if us is not None:
                        r.final.append(us)
                    elif r is not h:  # flaky now: out of the running
                        r.status = f"{status} (re-timing)"
                        top.remove(r)
        best = min([h, *top], key=lambda r: r.median_us if r.median_us is not None else float("inf"))
        res.best = best if best.median_us is not None else None
        hm, bm = h.median_us, best.median_us
        res.winner = bool(best is not h and hm and bm and bm <= (1 - self.opts.margin) * hm)
        if h.status.startswith("check-failed"):
            res.note = "the heuristic fails its gate"

    def _open(self, st: _Scenario) -> None:
        st.inputs = [self.op.make_inputs(st.s, i, self.device) for i in range(st.result.layers)]

    def _close(self, st: _Scenario) -> None:
        st.inputs = None
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    # ---- the loop

    def run(self, on_scenario: Callable[[TuneResult], None] | None = None) -> TuneResult:
        scenarios = select(self.op, self.opts)
        states = [_Scenario(self.op, s, self.limits, self.opts.layers) for s in scenarios]
        result = TuneResult(self.op.name, self.how, self.opts.margin, _device_name(self.device),
                            [st.result for st in states])
        total = sum(len(st.cands) + self.limits.phase_b for st in states)
        self.bar = Progress(total, f"tune {self.op.name}", enabled=self.opts.progress)
        if states:
            self.compiler.submit(states[0].s, [c for _, c in states[0].cands])
        pending: _Scenario | None = None
        try:
            for i, st in enumerate(states):
                if i + 1 < len(states):
                    self.compiler.submit(states[i + 1].s, [c for _, c in states[i + 1].cands])
                left = None if self.opts.budget_s is None else max(0.0, self.opts.budget_s - self.elapsed())
                st.share = 0.0 if left is None else left / (len(states) - i)
                try:
                    self._open(st)
                except Exception as exc:  # noqa: BLE001 - a scenario that cannot be built is reported
                    if is_cuda_fault(exc):
                        raise _Fatal(f"{st.s.name}: inputs: {exc}") from exc
                    st.result.note = f"inputs failed: {type(exc).__name__}: {exc}"[:300]
                    self.bar.total -= len(st.cands) + self.limits.phase_b
                    continue
                self._phase(st, st.cands, 0.65 * st.share)
                st.cands_b = self._phase_b(st)
                self.bar.total -= self.limits.phase_b - len(st.cands_b)
                self.compiler.submit(st.s, [c for _, c in st.cands_b])
                if pending is not None:
                    self._finish(pending, result, on_scenario)
                pending = st
            if pending is not None:
                self._finish(pending, result, on_scenario)
        except _Fatal as exc:
            result.aborted = str(exc)
            print(f"\n[tune] stopped: CUDA error in this process: {exc}", file=self.log)
        finally:
            self.compiler.close()
            self.bar.close()
            result.elapsed_s = self.elapsed()
        return result

    def _finish(self, st: _Scenario, result: TuneResult, on_scenario) -> None:
        self._phase(st, st.cands_b, 0.25 * st.share)
        self._final(st)
        self._close(st)
        result.elapsed_s = self.elapsed()
        if on_scenario is not None:
            on_scenario(result)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def tune(op: TuneOp, opts: TuneOptions, on_scenario: Callable[[TuneResult], None] | None = None) -> TuneResult:
    """Tune `op` over its bench scenarios (see the module docstring); `on_scenario(partial)` runs after each
    scenario (the CLI rewrites its reports, so a run cut short keeps what it measured)."""
    return Tuner(op, opts).run(on_scenario)
