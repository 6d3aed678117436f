"""Compiling the candidates' kernels ahead, in worker processes, while the main process times others.

Triton compiles are CPU-bound (a GEMM variant takes seconds) and a timing loop that compiled each
candidate as it met it would spend most of its time compiling on one core. Workers (spawned processes)
run each candidate once on the scenario's layer-0 inputs with every Triton launch turned into a
`warmup` (compile, no launch: nothing of theirs runs on the GPU while the main process times), which
fills Triton's on-disk cache; the main process then loads the compiled kernels from it. A candidate
the op's own validation refuses (ValueError) or that fails to compile is reported from the worker and
never run in the main process.

Best effort: a worker that dies (BrokenProcessPool) gets its batch resubmitted once, one candidate per
job, to a fresh pool; a second crash marks the outstanding candidates as errors and later candidates
compile in the main process as they run. Triton's JIT holds the GIL for much of a compile (2 threads
compiled 1.2× as fast as one on a 2-core machine), hence processes, not threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import sys
from collections import OrderedDict
from typing import Any

from hpcops.bench.tune.space import Candidate, key

_WORKER_INPUTS: OrderedDict = OrderedDict()  # in a worker: layer-0 inputs of the last scenario
_WORKER_KEEP = 1
# A worker builds a scenario's inputs only while the GPU keeps this much free: the main process's timed
# layers come first (16 workers holding 8 GB each ran the main process out of memory on a 2-GPU H200).
WORKER_MIN_FREE = 48 << 30
_POISONED: list[str] = []  # in a worker: a CUDA error left its context unusable


def _warmup_only() -> None:
    """In a worker: every Triton launch compiles the kernel (into the disk cache) and launches nothing."""
    from triton.runtime.jit import JITFunction

    if getattr(JITFunction.run, "_hpcops_warmup_only", False):
        return
    real = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        return real(self, *args, grid=grid, warmup=True, **kwargs)

    run._hpcops_warmup_only = True
    JITFunction.run = run


def is_cuda_fault(exc: BaseException) -> bool:
    """A sticky CUDA error: the process's context is unusable afterwards."""
    text = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "illegal memory access" in text


def compile_job(op_spec: str, scenario: Any, cands: list[Candidate]) -> dict[tuple, str | None]:
    """In a worker: compile every candidate of `cands` for `scenario` (op `op_spec`, see `load_op`). Returns
    {candidate key: None (compiled, or not tried: the main process compiles it) | "invalid: ..." | "error: ..."}."""
    from hpcops.bench.tune import load_op

    out: dict[tuple, str | None] = {key(c): None for c in cands}
    if _POISONED:
        return out
    _warmup_only()
    op = load_op(op_spec)
    try:
        name = scenario.name
        if name not in _WORKER_INPUTS:
            import torch

            while len(_WORKER_INPUTS) >= _WORKER_KEEP:
                _WORKER_INPUTS.popitem(last=False)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
                if torch.cuda.mem_get_info()[0] < WORKER_MIN_FREE:
                    return out  # the main process compiles them as it runs them
            _WORKER_INPUTS[name] = op.make_inputs(scenario, 0, "cuda")
        x = _WORKER_INPUTS[name]
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: the main process compiles them
        if is_cuda_fault(exc):
            _POISONED.append(str(exc))
        return out
    for c in cands:
        try:
            with op.context(c):
                op.prepare(scenario, c)(x)()
        except ValueError as exc:  # the op's own argument/config validation
            out[key(c)] = f"invalid: {exc}"[:300]
        except Exception as exc:  # noqa: BLE001 - reported on the candidate's row
            if is_cuda_fault(exc):
                _POISONED.append(str(exc))
                return out
            out[key(c)] = f"error: compile: {type(exc).__name__}: {exc}"[:300]
    return out


class Compiler:
    """Submits candidates to `jobs` worker processes and answers, per candidate, what they found."""

    def __init__(self, op_spec: str | None, jobs: int, *, log=sys.stderr):
        """`op_spec`: where a worker finds the op (`load_op`); None or `jobs` 0: no workers."""
        self.op_spec, self.jobs, self.log = op_spec, jobs, log
        self.pool: cf.ProcessPoolExecutor | None = None
        self.futures: dict[tuple, tuple[cf.Future, Any, Candidate]] = {}
        self.failed: dict[tuple, str] = {}
        self.restarts = 0
        self.enabled = jobs > 0 and op_spec is not None

    def _pool(self) -> cf.ProcessPoolExecutor:
        if self.pool is None:
            self.pool = cf.ProcessPoolExecutor(max_workers=self.jobs, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    def submit(self, scenario: Any, cands: list[Candidate], *, chunk: int | None = None) -> None:
        """Queue `cands` of `scenario` (those not queued yet), in at most `jobs` batches."""
        if not self.enabled:
            return
        todo = [c for c in cands if (scenario.name, key(c)) not in self.futures]
        if not todo:
            return
        n = chunk or max(1, -(-len(todo) // self.jobs))
        try:
            for i in range(0, len(todo), n):
                part = todo[i:i + n]
                fut = self._pool().submit(compile_job, self.op_spec, scenario, part)
                for c in part:
                    self.futures[(scenario.name, key(c))] = (fut, scenario, c)
        except Exception as exc:  # noqa: BLE001 - a pool that cannot start: compile in the main process
            print(f"[tune] compile workers unavailable ({type(exc).__name__}: {exc}); compiling in-process",
                  file=self.log)
            self.close()
            self.enabled = False

    def ready(self, scenario: Any, cand: Candidate) -> bool:
        """Whether `status` answers without waiting."""
        entry = self.futures.get((scenario.name, key(cand)))
        return entry is None or entry[0].done()

    def status(self, scenario: Any, cand: Candidate, *, timeout: float = 600.0) -> str | None:
        """None: compiled (or left to the main process); else the candidate's "invalid: ..." / "error: ..."."""
        k = (scenario.name, key(cand))
        for _ in range(3):
            if k in self.failed:
                return self.failed[k]
            entry = self.futures.get(k)
            if entry is None:
                return None
            try:
                return entry[0].result(timeout=timeout).get(k[1])
            except cf.process.BrokenProcessPool:
                self._recover()
            except cf.TimeoutError:
                return f"error: compile: no answer from the worker within {timeout:.0f} s"
            except Exception as exc:  # noqa: BLE001 - anything else from the pool: compile here
                print(f"[tune] compile job failed ({type(exc).__name__}: {exc})", file=self.log)
                return None
        return None

    def _recover(self) -> None:
        outstanding = {k: v for k, v in self.futures.items()
                       if not v[0].done() or v[0].cancelled() or v[0].exception() is not None}
        self.close()
        self.restarts += 1
        for k in outstanding:
            del self.futures[k]
        if self.restarts > 1:
            print(f"[tune] compile workers crashed again: {len(outstanding)} candidates not run; the rest "
                  "compile in-process", file=self.log)
            self.enabled = False
            for k in outstanding:
                self.failed[k] = "error: compile workers crashed (twice) while this candidate was queued"
            return
        print(f"[tune] a compile worker crashed: {len(outstanding)} candidates resubmitted one per job",
              file=self.log)
        for _, scenario, cand in outstanding.values():
            self.submit(scenario, [cand], chunk=1)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
