"""`hpcops tune decode`: the decode launch knobs over the `decode` bench suite's scenarios (a report).

Knobs: `DecodeConfig` (process-wide, `decode.set_decode_config`: pipeline depth, warps, TMA, PDL, score-tile
rows, keys per step) and the plan's programs per SM and minimum tiles per program (`plan_decode`'s
`num_programs`, `min_tiles`). Inputs are the suite's (`make_decode_inputs`, each layer its own caches);
the gate compares the load-balanced schedule with the torch reference as the suite's check does; times
are CUDA-graph replays (the bench's `hpcops` row). No tuned table: the defaults live in
`DecodeConfig` and `plan.py`, changed by hand from what this reports.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, fields
from typing import Any

from hpcops.bench.suites import decode as suite
from hpcops.bench.tune.engine import TuneOp
from hpcops.bench.tune.space import Candidate, knob

# One line per knob; `pps` = persistent programs per SM, `min_tiles` = the plan's tile floor per program.
# num_warps None = the launcher's choice (4 for head_dim <= 128).
SPACE = (
    knob("pps", 1, 2, 3, 4, 6),
    knob("min_tiles", 2, 4, 8, 16),
    knob("pdl", False, True),
    knob("use_tma", False, True),
    knob("num_warps", None, 1, 2, 8, near=None),
    # fewer warps per program want more programs per SM (loads in flight); a 1-warp tile keeps the
    # softmax reductions inside a warp
    knob(("num_warps", "pps"), (1, 4), (1, 6), (2, 3), (2, 4), near=None),
    knob("num_stages", 2, 3, 4),
    knob("min_rows", 16, 64),
    knob("block_n", 64, 128),
)
PLAN_KNOBS = ("pps", "min_tiles")


def _config_fields() -> tuple[str, ...]:
    from hpcops.attention.decode import DecodeConfig

    return tuple(f.name for f in fields(DecodeConfig))


class DecodeTune(TuneOp):
    name = "decode"
    timing = "graph"
    space = SPACE

    def scenarios(self, quick: bool) -> list[suite.Scenario]:
        return suite.scenarios(quick)

    def base(self, s: suite.Scenario) -> Candidate:
        from hpcops.attention.decode import DecodeConfig
        from hpcops.attention.plan import DEFAULT_MIN_TILES, DEFAULT_PROGRAMS_PER_SM

        return {**asdict(DecodeConfig()), "pps": DEFAULT_PROGRAMS_PER_SM, "min_tiles": DEFAULT_MIN_TILES}

    def make_inputs(self, s: suite.Scenario, layer: int, device: str) -> dict[str, Any]:
        return suite.make_decode_inputs(s.lens, s.hq, s.hkv, s.fp8, seed=layer, device=device)

    def bytes(self, s: suite.Scenario) -> int:
        return s.bytes

    def params(self, s: suite.Scenario) -> dict[str, Any]:
        return dict(spec=s.spec, hq=s.hq, hkv=s.hkv, kv="fp8" if s.fp8 else "bf16", page=suite.PAGE,
                    d=suite.HEAD_DIM)

    @contextlib.contextmanager
    def context(self, cand: Candidate):
        from hpcops.attention import decode as dec

        old = dec.set_decode_config(**{f: cand[f] for f in _config_fields() if f in cand})
        try:
            yield
        finally:
            dec.set_decode_config(**asdict(old))

    def prepare(self, s: suite.Scenario, cand: Candidate):
        def prepare(x):
            import hpcops
            from hpcops._platform import num_sms

            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=x["k_cache"].shape[2], block_size=suite.PAGE,
                                      num_programs=cand["pps"] * num_sms(x["q"].device),
                                      min_tiles=cand["min_tiles"])
            return lambda: hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"],
                                                   x["seq_lens"], plan=plan, k_scale=x["k_scale"],
                                                   v_scale=x["v_scale"], out=x["out"])
        return prepare

    def gate(self, s: suite.Scenario, x: dict[str, Any], cand: Candidate, name: str) -> None:
        from hpcops.attention import reference as ref
        from hpcops.testing import assert_close

        x["out"].fill_(float("nan"))
        got = self.prepare(s, cand)(x)()
        if "reference" not in x:
            x["reference"] = ref.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"],
                                                  x["seq_lens"], k_scale=x["k_scale"], v_scale=x["v_scale"])
        assert_close(x["reference"], got, name=f"decode [{name}]")


OP = DecodeTune()
