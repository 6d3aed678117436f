"""`hpcops tune prefill`: `PrefillConfig` over the `prefill` bench suite's scenarios (a report).

A scenario is a bench case with the q the bench times there: bf16 q, and for fp8 KV also fp8 q with
per-token-head scales (`-fp8q`). Knobs: the (block_m, num_warps) tile, block_n, pipeline depth, TMA (auto
or off), pv_fp8 (fp8 KV with fp8 q or quant_q), quant_q (bf16 q over fp8 KV), heads_inner, fma_scale.
Inputs and timing (CUDA-graph replay) are the suite's; a candidate runs as the suite's config variants
do (`_ours(fp8_q, variant)`) and is gated on the suite's sampled fp32 reference. No tuned table:
`prefill_config` is changed by hand from what this reports.

`hpcops tune prefill-gluon`: the Gluon kernel's tiles (`PrefillConfig.gluon`, `gluon_config`) on the bf16 scenarios
and the fp8-q ones over fp8 KV (its dtypes; fp8 on the warp-specialized kernel only): the warp-specialized kernel or
not, the (block_m, num_warps) tile, block_n, pipeline depth and launch order, P in registers or in two shared
buffers (fp8), the softmax under its own P·V (16-bit: `gluon_pv_overlap`), the row sums on the tensor cores
(fp8: `gluon_mma_sum`), its tree reductions (`gluon_tree`) and the fp8 V transpose by byte permutes (`gluon_vt_prmt`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from hpcops.bench import get_suite
from hpcops.bench.suites import prefill as suite
from hpcops.bench.tune.engine import TuneOp
from hpcops.bench.tune.space import Candidate, knob

SPACE = (
    knob(("block_m", "num_warps"), (128, 8), (64, 4), (64, 8), near=None),
    knob("block_n", 64, 128),
    knob("num_stages", 2, 3, 4),
    knob("tma", None, False, near=None),  # None: TMA wherever the cache layout allows it
    knob("pv_fp8", False, True),
    knob("quant_q", False, True),
    knob("heads_inner", False, True),
    knob("fma_scale", True, False),
)


@dataclass(frozen=True)
class PrefillCase:
    s: suite.Scenario
    fp8_q: bool

    @property
    def name(self) -> str:
        return self.s.name + ("-fp8q" if self.fp8_q else "")


class PrefillTune(TuneOp):
    name = "prefill"
    timing = "graph"
    space = SPACE

    def scenarios(self, quick: bool) -> list[PrefillCase]:
        out = []
        for c in get_suite("prefill")({"quick": quick}):
            p = c.params
            s = suite.Scenario(p["spec"], p["hq"], p["hkv"], p["kv"] == "fp8")
            out += [PrefillCase(s, False)] + ([PrefillCase(s, True)] if s.fp8 else [])
        return out

    def base(self, c: PrefillCase) -> Candidate:
        from hpcops.attention.prefill import prefill_config

        cfg = prefill_config(head_dim=suite.HEAD_DIM, group=c.s.hq // c.s.hkv,
                             max_seqlen_q=max(q for q, _ in c.s.reqs),
                             q_dtype=suite.FP8 if c.fp8_q else torch.bfloat16,
                             kv_dtype=suite.FP8 if c.s.fp8 else torch.bfloat16)
        return asdict(cfg)

    def valid(self, c: PrefillCase, cand: Candidate) -> bool:
        # the flags act only where their dtypes are (elsewhere a candidate would repeat another)
        if cand["quant_q"] and (c.fp8_q or not c.s.fp8):
            return False
        return not (cand["pv_fp8"] and not (c.s.fp8 and (c.fp8_q or cand["quant_q"])))

    def make_inputs(self, c: PrefillCase, layer: int, device: str) -> dict[str, Any]:
        return suite._make_inputs(c.s, layer, device)

    def bytes(self, c: PrefillCase) -> int:
        return c.s.bytes

    def params(self, c: PrefillCase) -> dict[str, Any]:
        return {"spec": c.s.spec, "hq": c.s.hq, "hkv": c.s.hkv, "head_dim": suite.HEAD_DIM,
                "kv": "fp8" if c.s.fp8 else "bf16", "q": "fp8" if c.fp8_q else "bf16"}

    def prepare(self, c: PrefillCase, cand: Candidate):
        return suite._ours(c.fp8_q, cand, check=False)  # gated by `gate`, compiled in workers that launch nothing

    def gate(self, c: PrefillCase, x: dict[str, Any], cand: Candidate, name: str) -> None:
        from hpcops.testing import assert_close

        got = self.prepare(c, cand)(x)()
        fp8_ref = c.fp8_q or (cand["quant_q"] and c.s.fp8)  # quant_q rounds q as quantize_per_token_head does
        ref_key = "reference_fp8q" if fp8_ref else "reference"
        if ref_key not in x:
            x[ref_key] = suite._sampled_reference(x, *((x["q8"], x["q_scale"]) if fp8_ref else (x["q"], None)))
        rows, heads, want = x[ref_key]
        # P·V as an fp8 dot rounds the probabilities to e4m3 (3 mantissa bits): a wider tolerance there
        e4m3_p = (cand["pv_fp8"] or cand["gluon"]) and c.s.fp8  # the Gluon fp8 kernel's P·V is always fp8
        tol = {"maxtol": 6e-2, "rmstol": 3e-2} if e4m3_p else {}
        assert_close(want, got[rows][:, heads], name=f"prefill [{name}]", **tol)


GLUON_SPACE = (
    knob("gluon_ws", False, True),
    knob(("block_m", "num_warps"), (128, 8), (64, 4), near=None),
    # the byte-permute transpose (gluon_vt_prmt, the fp8 default) needs 128-key tiles: 64 keys go without it
    knob(("block_n", "gluon_vt_prmt"), values_fn=lambda base, s: ((64, False), (128, base["gluon_vt_prmt"]))),
    knob("num_stages", 2, 3, 4),
    knob("heads_inner", False, True),
    knob("gluon_p_regs", False, True),
    knob("gluon_tree", False, True),
    knob("gluon_p_dbuf", False, True),
    knob("gluon_pv_overlap", False, True),
    knob("gluon_mma_sum", False, True),
    knob("gluon_persist", False, True),
    knob("gluon_prefetch", False, True),
    knob("gluon_q_regs", False, True),
    knob("gluon_vt_prmt", False, True),
    knob("gluon_wide_store", False, True),
)


class PrefillGluonTune(PrefillTune):
    name = "prefill-gluon"
    space = GLUON_SPACE

    def scenarios(self, quick: bool) -> list[PrefillCase]:
        return [c for c in super().scenarios(quick) if c.fp8_q or not c.s.fp8]  # no bf16 q over fp8 KV

    def base(self, c: PrefillCase) -> Candidate:
        from hpcops.attention.prefill import gluon_config

        # fp8 q: the warp-specialized tile, also where few tiles would take 64 rows for a 16-bit q
        return asdict(gluon_config(head_dim=suite.HEAD_DIM, group=c.s.hq // c.s.hkv,
                                   max_seqlen_q=max(q for q, _ in c.s.reqs), num_kv_heads=c.s.hkv,
                                   total_q=sum(q for q, _ in c.s.reqs), fp8=c.fp8_q))

    def valid(self, c: PrefillCase, cand: Candidate) -> bool:
        """The launcher's own rules for the config (`gluon_config_reason`: the dtype's paths and knobs, the tile,
        shared memory), at the suite's head_dim and pages."""
        from hpcops.attention.prefill import PrefillConfig, gluon_config_reason

        return gluon_config_reason(PrefillConfig(**cand), fp8=c.fp8_q, head_dim=suite.HEAD_DIM,
                                   group=c.s.hq // c.s.hkv, page=suite.PAGE, elem_bytes=1 if c.fp8_q else 2) is None


OP = PrefillTune()
GLUON_OP = PrefillGluonTune()
