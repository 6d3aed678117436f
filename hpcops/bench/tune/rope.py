"""`hpcops tune rope`: the prologue's launch shape (`RopeConfig`) over the `rope` bench suite's scenarios.

Knobs: the q programs' (block_t, num_warps) shape, every one of a list; the kv programs' block_kv
(None = `default_block_kv` for the candidate's block_t, or ½×, 2×, 4× the heuristic's); cos/sin through
shared memory. Inputs, gate (`_check`: q, q_scale, the written cache rows, nothing else written) and
timing (CUDA-graph replay, the bench's `hpcops` row) are the suite's. The gate calls
`rope_norm_store_kv` without a config, so a candidate's config is made that function's default while
it is checked and timed. No tuned table: `default_config` is changed by hand from what this reports.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hpcops.bench import get_suite
from hpcops.bench.suites import rope as suite
from hpcops.bench.tune.engine import TuneOp
from hpcops.bench.tune.space import Candidate, knob

FIELDS = ("block_t", "num_warps", "block_kv", "cos_sin_smem")  # RopeConfig, in its positional order
# q tiles of 8..64 elements per thread (32·block_t/num_warps for a group of 8)
SHAPES = ((1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8))


def _block_kv_values(base: Candidate, s: suite.Scenario) -> tuple:
    from hpcops.rope.prologue import default_block_kv

    kv = default_block_kv(base["block_t"], s.t, s.hq, s.hkv)
    return (None, *(k for k in (kv // 2, kv * 2, kv * 4) if 1 <= k <= 64))


SPACE = (
    knob(("block_t", "num_warps"), *SHAPES, near=None),
    knob("block_kv", values_fn=_block_kv_values, near=None),
    knob("cos_sin_smem", False, True),
)


class RopeTune(TuneOp):
    name = "rope"
    timing = "graph"
    space = SPACE

    def scenarios(self, quick: bool) -> list[suite.Scenario]:
        return [suite.Scenario(c.params["T"], c.params["hq"], c.params["hkv"], c.params["kv"] == "fp8")
                for c in get_suite("rope")({"quick": quick})]

    def base(self, s: suite.Scenario) -> Candidate:
        from hpcops.rope.prologue import default_block_kv, default_config

        c = default_config(s.t, s.hq, s.hkv, suite.HEAD_DIM)  # this machine's SM count (a default on the CPU)
        kv = None if c.block_kv == default_block_kv(c.block_t, s.t, s.hq, s.hkv) else c.block_kv
        return {"block_t": c.block_t, "num_warps": c.num_warps, "block_kv": kv, "cos_sin_smem": c.cos_sin_smem}

    def make_inputs(self, s: suite.Scenario, layer: int, device: str) -> dict[str, Any]:
        return suite._make_inputs(s, layer, device)

    def bytes(self, s: suite.Scenario) -> int:
        return s.bytes

    def params(self, s: suite.Scenario) -> dict[str, Any]:
        return {"T": s.t, "hq": s.hq, "hkv": s.hkv, "head_dim": suite.HEAD_DIM, "kv": "fp8" if s.fp8 else "bf16"}

    @contextlib.contextmanager
    def context(self, cand: Candidate):
        from hpcops.rope import prologue

        real = prologue.rope_norm_store_kv
        cfg = prologue.RopeConfig(*(cand[f] for f in FIELDS))

        def with_config(*args, **kw):
            kw.setdefault("config", cfg)
            return real(*args, **kw)

        prologue.rope_norm_store_kv = with_config  # the suite's gate imports it from the module at call time
        try:
            yield
        finally:
            prologue.rope_norm_store_kv = real

    def prepare(self, s: suite.Scenario, cand: Candidate):
        return suite._ours(s, tuple(cand[f] for f in FIELDS))

    def gate(self, s: suite.Scenario, x: dict[str, Any], cand: Candidate, name: str) -> None:
        suite._check(s)(x)  # inside `context(cand)`: checks this candidate's config


OP = RopeTune()
