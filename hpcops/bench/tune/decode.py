"""`hpcops tune decode`: the decode launch knobs over the `decode` bench suite's scenarios (a report).

Knobs: `DecodeConfig` (process-wide, `decode.set_decode_config`: pipeline depth, warps, TMA, PDL, score-tile
rows, keys per step, task descriptors, lean loop and its addressing, register cap) and the plan's programs per
SM, minimum tiles per program, task cost and snap (`plan_decode`'s `num_programs`, `min_tiles`, `task_cost`,
`snap`).
Inputs are the suite's (`make_decode_inputs`, each layer its own caches); the gate compares the load-balanced
schedule with the torch reference as the suite's check does; times are CUDA-graph replays of the bench's
`hpcops-fp8q` row over fp8 KV (the prologue's fp8 q; tunes before 2026-12 timed the bf16-q `hpcops` row there,
level within ~2 %) and its `hpcops` row over 16-bit KV, the plan outside the graph; the "... fp8 q16" scenarios
(not in `--quick`) time the bf16-q `hpcops` row over fp8 KV (`--only q16`). `--knobs task_cost,snap,min_tiles`
moves only those.

The plan kernel's own launch (`DecodeConfig.plan_block_c`, `plan_warps`, `plan_block_b`) is tuned on
separate `plan ...` scenarios (`--only plan`), which time the plan step alone: one graph of 8 plan
launches, each over its own seq_lens (the bench's `hpcops-plan` row times one eager launch, so its
figure also holds the launch overhead); the gate compares the tables with the torch reference. The
decode knobs are not moved on plan scenarios, nor the plan launch knobs on decode scenarios.

No tuned table: the defaults live in `DecodeConfig` and `plan.py`, changed by hand from what this reports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from hpcops.bench.suites import decode as suite
from hpcops.bench.tune.engine import TuneOp
from hpcops.bench.tune.space import Candidate, Knob, knob


@dataclass(frozen=True)
class PlanScenario:
    """The plan step alone for a batch `spec` (lengths as in the decode suite) and `hkv` kv heads."""

    spec: str
    hkv: int

    @property
    def name(self) -> str:
        return f"plan {self.spec} hkv{self.hkv}"

    @property
    def lens(self) -> list[int]:
        return suite.parse_lengths(self.spec)

    @property
    def bytes(self) -> int:
        return 4 * len(self.lens)


# B 16..256 (the deliverable: <= 4 us) and one batch past the one-pass scan (looped blocks)
PLAN_SCENARIOS = (PlanScenario("16x4K", 1), PlanScenario("32x0.125K+32x4K", 1), PlanScenario("128x2K", 1),
                  PlanScenario("256x1K", 1), PlanScenario("256x1K", 8), PlanScenario("1024x0.5K", 1))
PLAN_QUICK = (PlanScenario("32x0.125K+32x4K", 1), PlanScenario("256x1K", 1))


def _on(kind: str, k: Knob) -> Knob:
    """`k` moved only on scenarios of `kind` ("plan" or "decode"); skipped (no values) on the others."""
    vals = k.values

    def values(base, s):
        if (kind == "plan") != isinstance(s, PlanScenario):
            return ()
        return vals(base, s) if callable(vals) else vals

    return replace(k, values=values)


def _at_gqa1(*values: Any):
    """A knob's values on GQA-1 scenarios (hq == hkv: one query row a kv head, where `row_path` acts), none
    elsewhere (there the move would time the heuristic again)."""
    return lambda base, s: values if s.hq == s.hkv else ()


# One line per knob; `pps` = persistent programs per SM, `min_tiles` = the plan's tile floor per program.
# num_warps None = the launcher's choice (4 for head_dim <= 128).
DECODE_SPACE = (
    # split requests merged in the attention kernel's tail (no combine kernel), alone and with 3 programs an SM
    knob("tail_merge", False, True),
    knob(("tail_merge", "pps"), (True, 3), near=None),
    knob(("gluon", "tail_merge", "pps"), (True, True, 2), (True, True, 3), (True, True, 4), near=None),
    knob(("gluon", "tail_merge", "tail_group", "pps"), (True, True, 8, 3), (True, True, 32, 3), (True, True, 0, 3),
         near=None),
    knob(("tail_merge", "tail_group"), (True, 8), (True, 0), near=None),
    # the combine kernel instead of the tail merge on a Gluon plan, at 2 or 3 programs an SM (the bench's
    # `hpcops-gluon` row, combine at 2: an H100 ran it ~1.10x faster than `hpcops-fp8q` on the long h8/1 fp8 rows)
    knob(("tail_merge", "pps"), (False, 2), (False, 3), near=None),
    # a long split's merge (more than 16 partials) in column slices over its owner and the next combine programs
    knob("merge_slices", 1, 2, 8),  # the default (None) is 4
    # the combine on 2 warps (the default: shorter reductions, more programs an SM) or 4, alone and with the slices
    knob("combine_warps", 2, 4),
    knob(("merge_slices", "combine_warps"), (1, 4), (8, 4), near=None),
    knob("merge_prefetch", False, True),
    # the tl kernel over fp8 KV under a bf16 q builds to 189 registers (the static kernel: 150; 64x0.5K h8/1 under
    # Nsight Compute, session 52): capped at 152 / 128 (24 / 16 bytes spilled, sm_90 build) for 3 / 4 programs an SM,
    # with the equal cut and without
    knob(("max_regs", "pps"), (152, 3), (128, 4), near=None),
    knob(("split_cost", "max_regs", "pps"), (0, 152, 3), (0, 128, 4), near=None),
    # wider Gluon merge rounds (8 partials of 8 rows at d128) without the prefetch (with it: 2 programs an SM),
    # alone and with groups of 16 / 32 partials
    knob(("merge_round", "merge_prefetch"), (8192, False), near=None),
    knob(("merge_round", "merge_prefetch", "tail_group"), (8192, False, 16), (8192, False, 32), (4096, True, 32),
         near=None),
    knob("tail_group", 8, 32, 0),
    # the Gluon kernel (sm_90; where it applies, else the tl kernel runs and this re-times the default)
    knob("gluon", False, True),
    # with more programs an SM (its ~85 registers leave room; the split-KV probe was fastest at ~4 an SM)
    knob(("gluon", "pps"), (True, 3), (True, 4), (True, 6), near=None),
    # the Gluon kernel's P·V over fp8 V in fp16 (one conversion a pair), V masked on a request's last tile only
    knob("pv_fp16", False, True),
    knob("v_mask_tail", False, True),
    knob(("pv_fp16", "v_mask_tail"), (True, True), near=None),
    # GQA 1 (one query row a kv head): the CUDA-core row path (DecodeConfig.row_path), alone, on 8 warps (half
    # its [block_n, D] per-slot accumulator a thread: ~128 registers instead of ptxas's ~222 on fp8 KV, d 128)
    # and capped at 168 registers for 3 programs an SM (fp8 KV: no spills; bf16 spills 72 bytes)
    knob("row_path", values_fn=_at_gqa1(False, True)),
    knob(("row_path", "num_warps"), values_fn=_at_gqa1((True, 8)), near=None),
    knob(("row_path", "max_regs", "pps"), values_fn=_at_gqa1((True, 168, 3)), near=None),
    # pages smaller than a step (16, 32): the lean loop with a page id a key row, or the masked loop
    knob("lean_pages", True, False),
    # first (a --quick run reaches both): the lean loop's leaner addressing (DecodeConfig.lean_mode;
    # fewer registers than "hold"'s 255, tests/test_decode_compile.py), on 16-bit KV too
    knob(("lean_loop", "use_tma", "lean_mode"), (True, False, "recompute"), (True, True, "tma"), near=None),
    # a register cap (ptxas .maxnreg) with the programs an SM it makes room for: 168 = 3, 128 = 4
    knob(("lean_loop", "max_regs", "pps"), (True, 168, 3), (True, 128, 4), near=None),
    # the per-task chain (descriptors) and the per-tile cost (lean loop), alone and together
    knob("task_desc", False, True),
    knob("lean_loop", False, True),
    knob(("task_desc", "lean_loop"), (True, True), near=None),
    knob("pps", 1, 2, 3, 4, 6),
    knob(("lean_loop", "num_stages"), (True, 4), near=None),
    # fewer registers fit more programs an SM (tma: ~128 registers, 4 programs of 4 warps)
    knob(("lean_loop", "use_tma", "lean_mode", "pps"), (True, True, "tma", 3), (True, True, "tma", 4),
         (True, False, "recompute", 3), near=None),
    knob(("lean_loop", "lean_mode", "max_regs", "pps"), (True, "recompute", 168, 3), (True, "recompute", 128, 4),
         near=None),
    knob(("lean_loop", "use_tma", "lean_mode", "max_regs", "pps"), (True, True, "tma", 128, 4), near=None),
    knob("min_tiles", 2, 4, 8, 16),
    # the plan's cost model: what a task costs on top of its tiles (quarters of a tile; 0 = equal-tile cut),
    # and the snap that keeps a request whole when a cut would leave a small piece of it
    knob("task_cost", 0, 4, 6, 8, 12, 16, near=None),
    knob("snap", 0, 4, 16, near=None),
    knob(("task_cost", "snap"), (12, 0), (12, 16), (16, 16), (6, 0), near=None),
    knob(("task_cost", "min_tiles"), (8, 2), (8, 1), near=None),
    # what a split costs (DecodeConfig.split_cost): up to that much longer buckets of whole requests, no split
    knob("split_cost", 0, 8, 16, 24, 32, 64, 128, near=None),
    knob(("split_cost", "min_tiles"), (32, 2), (64, 2), (32, 1), near=None),
    # the equal cut at 1 / 2 / 3 programs an SM: at 1 a short uniform batch's requests in about two halves instead
    # of whole; at 2 / 3 the static split's shape (64x0.5K h8/1, bf16 q over fp8 KV: static 11.7 µs against the
    # dynamic plan's 13.3 on the H200; pps 1 with the equal cut 12.8)
    knob(("split_cost", "pps"), (0, 1), (0, 2), (0, 3), near=None),
    # the equal-tile cut (no task cost) with a 2-tile floor: on a uniform batch of 8-tile requests every program
    # holds one request's 2-tile chunk, the static split's cut, one task a program
    knob(("split_cost", "task_cost", "min_tiles", "pps"), (0, 0, 2, 2), (0, 0, 2, 3), (0, 0, 1, 2), (0, 0, 4, 2),
         (0, 0, 1, 4), near=None),
    knob(("split_cost", "task_cost", "min_tiles", "tail_merge"), (0, 0, 2, True), near=None),
    # the cost model scaled for a dearer tile (a 16-bit q over fp8 KV: the tl kernel converts every tile): a task
    # start, a split and the tile floor worth fewer tiles; on 64x0.5K h8/1 task cost 4 with a 2-tile floor cuts
    # each request in four 2-tile pieces, as the equal cut does, and a split cost under 18 lets it split (the
    # default there since dc4b7c9's tune: `decode.plan_costs`); last, the plain tile's costs (the defaults without
    # `decode.plan_costs`), where the plan took the converting tile's
    knob(("split_cost", "task_cost", "min_tiles"), (16, 4, 2), (0, 4, 2), (12, 4, 2), (16, 2, 2), (16, 4, 1),
         (16, 6, 2), (24, 4, 2), (40, 8, 4), near=None),
    knob("pdl", False, True),
    # the attention kernel itself launched with PDL (waits before its first read; the launch gap overlapped)
    knob("pdl_wait", False, True),
    knob("use_tma", None, False, True),
    knob("num_warps", None, 1, 2, 8, near=None),
    # fewer warps per program want more programs per SM (loads in flight); a 1-warp tile keeps the
    # softmax reductions inside a warp
    knob(("num_warps", "pps"), (1, 4), (1, 6), (2, 3), (2, 4), near=None),
    knob("num_stages", 2, 3, 4),
    knob("min_rows", 16, 64),
    knob("block_n", 64, 128),
)
# the plan kernel's launch, timed on the plan scenarios
PLAN_SPACE = (
    # one pass alone, then with smaller plan programs (the likely winners), first: --quick runs these
    knob(("plan_one_pass", "plan_block_c", "plan_warps"), (True, 128, 4), (True, 0, 4), (True, 16, 1), near=None),
    knob("plan_one_pass", False, True),
    knob(("plan_block_c", "plan_warps"), (0, 4), (16, 1), (32, 1), (16, 2), (32, 4), (64, 2), near=None),
    knob("plan_block_c", 16, 32, 64, 256, near=None),
    knob("plan_warps", 1, 2, 4, 8, near=None),
    knob("plan_block_b", 64, 256, 1024, near=None),
    # what the descriptors (DecodeConfig.task_desc) add to the plan step
    knob("task_desc", False, True),
)
SPACE = tuple(_on("decode", k) for k in DECODE_SPACE) + tuple(_on("plan", k) for k in PLAN_SPACE)
PLAN_KNOBS = ("pps", "min_tiles", "task_cost", "snap")


def _config_fields() -> tuple[str, ...]:
    from hpcops.attention.decode import DecodeConfig

    return tuple(f.name for f in fields(DecodeConfig))


@dataclass(frozen=True)
class Q16Scenario(suite.Scenario):
    """A decode scenario over fp8 KV timed with the bf16 q (the bench's `hpcops` row there: the `tl` kernel
    converting every KV tile, the row that `hpcops-static` is compared with); named "<scenario> q16"."""

    @property
    def name(self) -> str:
        return f"{super().name} q16"


def _query(x: dict[str, Any], s: Any = None):
    """The q a scenario is timed with: over fp8 KV the prologue's fp8 q and its scales (the bench's
    `hpcops-fp8q` row, the one issue 10's targets count, and the only one the Gluon kernel serves) unless the
    scenario is a `Q16Scenario`, else bf16."""
    return (x["q8"], x["q_scale"]) if "q8" in x and not isinstance(s, Q16Scenario) else (x["q"], None)


class DecodeTune(TuneOp):
    name = "decode"
    timing = "graph"
    space = SPACE

    def scenarios(self, quick: bool) -> list[suite.Scenario | PlanScenario]:
        base = suite.scenarios(quick)
        q16 = [] if quick else [Q16Scenario(s.spec, s.hq, s.hkv, s.fp8) for s in base if s.fp8]
        return [*base, *q16, *(PLAN_QUICK if quick else PLAN_SCENARIOS)]

    def base(self, s: suite.Scenario) -> Candidate:
        from hpcops.attention.decode import DecodeConfig
        from hpcops.attention.plan import DEFAULT_SNAP

        # pps, min_tiles, task_cost None: the plan's own choice (told the call's dtypes: 3 an SM for the Gluon kernel,
        # else 2; the tile costs of `decode.plan_costs`)
        return {**asdict(DecodeConfig()), "pps": None, "min_tiles": None, "task_cost": None, "snap": DEFAULT_SNAP}

    def make_inputs(self, s: suite.Scenario | PlanScenario, layer: int, device: str) -> dict[str, Any]:
        if isinstance(s, PlanScenario):
            import torch

            g = torch.Generator().manual_seed(layer)
            lens = torch.tensor(s.lens, dtype=torch.int32)
            jitter = torch.randint(0, suite.PAGE, lens.shape, generator=g, dtype=torch.int32)
            return {"seq_lens": (lens - jitter).clamp(min=0).to(device)}
        return suite.make_decode_inputs(s.lens, s.hq, s.hkv, s.fp8, seed=layer, device=device)

    def bytes(self, s: suite.Scenario | PlanScenario) -> int:
        return s.bytes

    def params(self, s: suite.Scenario | PlanScenario) -> dict[str, Any]:
        if isinstance(s, PlanScenario):
            return dict(spec=s.spec, batch=len(s.lens), hkv=s.hkv, step="plan")
        return dict(spec=s.spec, hq=s.hq, hkv=s.hkv, kv="fp8" if s.fp8 else "bf16", page=suite.PAGE,
                    d=suite.HEAD_DIM)

    def context(self, cand: Candidate):
        from hpcops.attention.decode import decode_config_changed

        return decode_config_changed(**{f: cand[f] for f in _config_fields() if f in cand})

    def prepare(self, s: suite.Scenario | PlanScenario, cand: Candidate):
        if isinstance(s, PlanScenario):
            return self._prepare_plan(s, cand)

        def prepare(x):
            import hpcops
            from hpcops._platform import num_sms

            _, page, hkv, d = x["k_cache"].shape
            q, q_scale = _query(x, s)
            # told what the calls take, as the bench's rows and a model's step (`decode.plan_kernel`)
            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page,
                                      num_programs=cand["pps"] * num_sms(x["q"].device) if cand["pps"] else None,
                                      min_tiles=cand["min_tiles"], task_cost=cand["task_cost"],
                                      snap=cand["snap"], num_q_heads=q.shape[1], head_dim=d, q_dtype=q.dtype,
                                      kv_dtype=x["k_cache"].dtype, max_seq_len=x["max_seq_len"])
            return lambda: hpcops.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"],
                                                   x["seq_lens"], plan=plan, k_scale=x["k_scale"],
                                                   v_scale=x["v_scale"], q_scale=q_scale, out=x["out"])
        return prepare

    def _prepare_plan(self, s: PlanScenario, cand: Candidate):
        def prepare(x):
            import hpcops
            from hpcops._platform import num_sms
            from hpcops.attention.plan import DEFAULT_PROGRAMS_PER_SM

            kw = dict(num_kv_heads=s.hkv, block_size=suite.PAGE, min_tiles=cand["min_tiles"],
                      task_cost=cand["task_cost"], snap=cand["snap"],
                      num_programs=(cand["pps"] or DEFAULT_PROGRAMS_PER_SM) * num_sms(x["seq_lens"].device))
            plan = hpcops.plan_decode(x["seq_lens"], **kw)
            return lambda: hpcops.plan_decode(x["seq_lens"], out=plan, **kw)
        return prepare

    def gate(self, s: suite.Scenario | PlanScenario, x: dict[str, Any], cand: Candidate, name: str) -> None:
        from hpcops.attention import reference as ref
        from hpcops.testing import assert_close

        if isinstance(s, PlanScenario):
            plan = self.prepare(s, cand)(x)()
            want = ref.plan_decode(x["seq_lens"].cpu(), num_kv_heads=s.hkv, block_size=suite.PAGE,
                                   num_programs=plan.num_programs, min_tiles=plan.min_tiles,
                                   task_cost=plan.task_cost, snap=plan.snap)
            want.has_desc = plan.has_desc
            assert plan.host_tables() == want.host_tables(), f"plan [{name}]: tables differ from the reference"
            return

        x["out"].fill_(float("nan"))
        got = self.prepare(s, cand)(x)()
        if "reference" not in x:
            q, q_scale = _query(x, s)
            x["reference"] = ref.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                                  k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=q_scale)
        assert_close(x["reference"], got, name=f"decode [{name}]")


OP = DecodeTune()


class DecodeGridTune(DecodeTune):
    """`hpcops tune decode-grid`: the same decode knobs over the `decode-grid` suite's cases (GQA, head_dim,
    page size, KV dtype, lengths: `hpcops/bench/suites/decode_grid.py`; `--quick` its 12-case subset), with
    that suite's inputs; `--only p16` and the like pick cases by name. The plan's launch is not moved here."""

    name = "decode-grid"

    def scenarios(self, quick: bool) -> list[Any]:
        from hpcops.bench.suites import decode_grid

        return decode_grid.scenarios(quick)

    def make_inputs(self, s: Any, layer: int, device: str) -> dict[str, Any]:
        from hpcops.bench.suites import decode_grid

        return decode_grid.make_inputs(s, layer, device)

    def params(self, s: Any) -> dict[str, Any]:
        return dict(spec=s.spec, hq=s.hq, hkv=s.hkv, kv=s.kv, page=s.page, d=s.d)


GRID_OP = DecodeGridTune()
