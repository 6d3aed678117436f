"""`hpcops tune` on the CPU: the search spaces, the search loop (a fake op with a cost model), the gate,
the tuned-table writer, the compile workers' fallback, and `hpcops tune moe --smoke` end to end through
the interpreter on a tiny MoE (timing stubbed: the bench's timing needs CUDA)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
from conftest import HAS_CUDA

from hpcops.bench import timing
from hpcops.bench.suites import moe as suite
from hpcops.bench.tune import OPS, get_op
from hpcops.bench.tune import moe as tmoe
from hpcops.bench.tune.compile import Compiler
from hpcops.bench.tune.engine import MAX_CANDIDATES, Limits, TuneOp, TuneOptions, phase_a, tune
from hpcops.bench.tune.space import combinations, key, knob, label, neighbours
from hpcops.cli import main
from hpcops.moe.configs import TUNABLE, MoeConfig, tuned_entry

H200 = "TEST GPU"  # a device with no entries in hpcops/moe/tuned.py (the real H200 has some)


@pytest.fixture
def gpu_heuristics(monkeypatch):
    """The spaces as the GPU builds them (the interpreter's heuristic takes larger tiles)."""
    import hpcops._platform

    monkeypatch.setattr(hpcops._platform, "is_interpreter", lambda: False)


@pytest.fixture
def tiny(tiny_moe_suite):
    """The moe suite at interpreter sizes (conftest)."""


# ---- search spaces -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["moe", "moe-shapes"])
def test_moe_space_bounded_valid_and_starts_at_the_heuristic(gpu_heuristics, name):
    from hpcops.bench import get_suite
    from hpcops.moe.configs import heuristic_config

    op = get_op(name)
    full, quick, smoke = Limits.of(False, False), Limits.of(True, False), Limits.of(False, True)
    assert full.phase_a + full.phase_b == MAX_CANDIDATES == 48
    scenarios = op.scenarios(False)
    # the bench's scenarios, less the dynamic-scale ones (fp8d: a tuned entry cannot tell them from fp8t)
    assert [s.name for s in scenarios] == [c.name for c in get_suite(name)({}) if "-fp8d" not in c.name]
    for s in scenarios:
        # phase A's own candidates (on a GPU the tuned table's config for the shape comes second, "current")
        cands = [c for ph, c in phase_a(op, s, full) if ph == "A"]
        h = heuristic_config(num_tokens=s.t, top_k=s.top_k, num_experts=s.e_global, hidden=s.hidden,
                             inter=s.inter, quant=s.kind, num_local_experts=s.e_local)
        assert cands[0] == {f: getattr(h, f) for f in TUNABLE}, s.name
        assert 10 <= len(cands) <= full.phase_a and len({key(c) for c in cands}) == len(cands)
        for c in cands:
            MoeConfig(**c)  # every candidate is a full, valid MoeConfig
            assert set(c) == set(TUNABLE)
            # one knob at a time (a knob may set fields together: down_n_per with down_block_k)
            moved = {f for f in c if c[f] != cands[0][f]}
            assert (not moved) if c is cands[0] else any(moved <= set(k.fields) for k in op.space), moved
            if s.kind == "fp8_block":
                assert c["block_k"] == c["down_block_k"] == 128 and 128 % c["block_n"] == 0
                assert 128 % c["down_block_n"] == 0
        assert len(phase_a(op, s, quick)) == quick.phase_a == 5
        smoke_a = [c for ph, c in phase_a(op, s, smoke) if ph == "A"]
        assert len(phase_a(op, s, smoke)) == 2 and smoke_a == cands[:len(smoke_a)]
    if name != "moe":
        return
    b4 = next(s for s in scenarios if s.name == "B4-tp8-fp8t")
    labels = [label(c, op.base(b4)) for ph, c in phase_a(op, b4, full) if ph == "A"]
    assert labels[:3] == ["heuristic", "naive_max_pairs=0", "swap_ab=0"]  # B4: one task per pair, swapped
    assert {"block_n=16", "block_n=64", "prequant_x=0"} <= set(labels)
    # a down program over 32 N tiles with one K step over I = 192 (the tuned T 16384 entry) is among the candidates
    # (on a GPU as the tuned table's "current" config, which phase A's equal candidate then repeats no more)
    # the gate-up K loop over 1-8 programs at decode batches (MoeConfig.split_k; the heuristic's 2 here), not at
    # prefill ones
    ep8 = next(s for s in scenarios if s.name == "B4-ep8-fp8b")
    assert op.base(ep8)["split_k"] == 2
    assert {"split_k=1", "split_k=4", "split_k=8"} <= {label(c, op.base(ep8)) for _, c in phase_a(op, ep8, full)}
    assert not any(c["split_k"] != 1 for s in scenarios if s.t > 64 for _, c in phase_a(op, s, full))
    big = next(s for s in scenarios if s.name == "B16384-tp8-fp8t")
    assert "down_block_k=256 down_n_per=32" in [label(c, op.base(big)) for _, c in phase_a(op, big, full)]


def test_other_ops_spaces_are_valid():
    from hpcops.attention.decode import DecodeConfig
    from hpcops.attention.prefill import PrefillConfig
    from hpcops.bench.tune.decode import PLAN_KNOBS
    from hpcops.rope.prologue import RopeConfig

    build = {"decode": lambda c: DecodeConfig(**{k: v for k, v in c.items() if k not in PLAN_KNOBS}),
             "rope": lambda c: RopeConfig(**c), "prefill": lambda c: PrefillConfig(**c)}
    for name, make in build.items():
        op = get_op(name)
        scenarios = op.scenarios(False)
        assert len(scenarios) >= len(op.scenarios(True)) > 0
        for s in scenarios:
            cands = [c for _, c in phase_a(op, s, Limits.of(False, False))]
            assert cands[0] == op.base(s) and len(cands) >= 4 and len({key(c) for c in cands}) == len(cands)
            for c in cands:
                make(c)
    pre = get_op("prefill")
    names = [s.name for s in pre.scenarios(True)]
    assert "h64x8-fp8-q2k-fp8q" in names and "h64x8-bf16-q2k-fp8q" not in names
    s = next(s for s in pre.scenarios(True) if s.name == "h64x8-bf16-q2k")
    assert not any(c["quant_q"] or c["pv_fp8"] for _, c in phase_a(pre, s, Limits.of(False, False)))


def test_a_new_field_is_one_knob():
    """Adding a field's candidate values to a space is one `knob(...)` line: phase A then moves it alone."""
    base = {"block_n": 32, "num_stages": 4, "swap_ab": False, "naive_max_pairs": 0}
    space = (knob("block_n", 16, 32, 64, 128), knob("swap_ab", False, True), knob("naive_max_pairs", 0, 16, 48))
    got = [label(c, base) for c in neighbours(base, space, None)]
    assert got == ["heuristic", "block_n=16", "block_n=64", "swap_ab=1", "naive_max_pairs=16"]
    far = knob("naive_max_pairs", 0, 16, 48, near=2)
    assert [label(c, base) for c in neighbours(base, (far,), None)] == ["heuristic", "naive_max_pairs=16",
                                                                         "naive_max_pairs=48"]
    assert [c["block_n"] for c in neighbours(base, space, None, valid=lambda c: c["block_n"] != 16)][:2] == [32, 64]


def test_phase_b_combines_the_winning_moves():
    base = {"a": 2, "b": 2, "c": 2, "d": False}
    space = (knob("a", 1, 2, 3, 4), knob("b", 1, 2, 3), knob("c", 1, 2, 3), knob("d", False, True))
    timed = [({**base, "a": 3}, 80.0), ({**base, "b": 1}, 90.0), ({**base, "c": 3}, 95.0),
             ({**base, "d": True}, 99.5), ({**base, "a": 1}, 120.0)]
    got = combinations(base, timed, 100.0, space, None)
    labels = [label(c, base) for c in got]
    # d=1 is within the 1 % noise band: not a winning move
    assert labels == ["a=3 b=1", "a=3 b=1 c=3", "a=3 c=3", "b=1 c=3", "a=4 b=1 c=3"]
    assert len(combinations(base, timed, 100.0, space, None, limit=2)) == 2
    assert combinations(base, timed[:1], 100.0, space, None) == [{**base, "a": 4}]
    assert combinations(base, [], 100.0, space, None) == []
    assert combinations(base, timed, 100.0, space, None, seen=[key(got[0])])[0] == got[1]


# ---- the search loop, on a fake op -------------------------------------------------------------------

@dataclass(frozen=True)
class FakeScenario:
    name: str


class FakeOp(TuneOp):
    """Times from a cost model: a=3 and b=1 are faster, c=3 is wrong (fails the gate) and fastest,
    b=3 is refused by the op's validation."""

    name = "fake"
    space = (knob("a", 1, 2, 3, 4), knob("b", 1, 2, 3), knob("c", 1, 2, 3))

    def scenarios(self, quick):
        return [FakeScenario("S1"), FakeScenario("S2")]

    def base(self, s):
        return {"a": 2, "b": 2, "c": 2}

    def make_inputs(self, s, layer, device):
        return {"layer": layer}

    def bytes(self, s):
        return 1 << 30

    def cost(self, c):
        if c["b"] == 3:
            raise ValueError("b=3 is refused")
        return 100.0 - 15 * (c["a"] == 3) - 10 * (c["b"] == 1) - 30 * (c["c"] == 3) + 20 * (c["a"] == 1)

    def prepare(self, s, c):
        return lambda x: (lambda: self.cost(c))

    def gate(self, s, x, c, name):
        self.cost(c)
        if c["c"] == 3:
            raise AssertionError(f"{name}: wrong output")


@pytest.fixture
def fake_timing(monkeypatch):
    calls = []

    def timed(fns, *a, **k):
        calls.append(len(fns))
        return fns[0]()

    monkeypatch.setattr(timing, "graph_time_us", timed)
    monkeypatch.setattr(timing, "profiler_kernel_time_us", timed)
    return calls


def test_search_gates_combines_and_keeps_the_winner(fake_timing):
    done = []
    res = tune(FakeOp(), TuneOptions(layers=3, progress=False, budget_s=None), on_scenario=done.append)
    assert len(done) == 2 and not res.aborted
    assert set(fake_timing) == {3}  # every layer's callable, in one timing
    s = res.scenarios[0]
    rows = {r.label: r for r in s.rows}
    assert [r.phase for r in s.rows][:1] == ["A"] and s.heuristic.label == "heuristic"
    assert rows["c=3"].status.startswith("check-failed") and rows["c=3"].us is None  # fastest, never ranked
    assert rows["b=3"].status.startswith("invalid") and rows["b=3"].us is None
    assert rows["a=3"].us == 85.0 and rows["b=1"].us == 90.0
    assert rows["a=3 b=1"].phase == "B" and rows["a=3 b=1"].us == 75.0
    assert s.best.label == "a=3 b=1" and s.winner and s.speedup == pytest.approx(100 / 75)
    assert len(s.best.final) == 2 and len(s.heuristic.final) == 2  # re-timed interleaved, 2 rounds
    assert len(s.rows) <= MAX_CANDIDATES


def test_search_without_a_margin_keeps_the_heuristic(fake_timing, monkeypatch):
    monkeypatch.setattr(FakeOp, "cost", lambda self, c: 100.0 - 2 * (c["a"] == 3))  # 2 % < the 3 % margin
    res = tune(FakeOp(), TuneOptions(layers=1, progress=False, budget_s=None))
    s = res.scenarios[0]
    assert s.best.label == "a=3" and not s.winner


def test_budget_skips_candidates_but_times_every_heuristic(fake_timing):
    res = tune(FakeOp(), TuneOptions(layers=1, progress=False, budget_s=1e-9))
    for s in res.scenarios:
        assert s.heuristic.us == 100.0 and s.heuristic.status == "ok"
        assert all(r.status == "skipped: time budget" for r in s.rows[1:])
        assert not s.measured and not s.winner


def test_a_cuda_fault_stops_the_tune_and_keeps_what_was_measured(fake_timing, tmp_path):
    """A sticky CUDA error in the main process ends the run (nothing more can run there); the reports
    still hold the scenarios measured before it."""
    from hpcops.bench.tune import report

    class Faulty(FakeOp):
        def gate(self, s, x, c, name):
            if s.name == "S2" and c["a"] == 1:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            super().gate(s, x, c, name)

    res = tune(Faulty(), TuneOptions(layers=1, progress=False, budget_s=None))
    assert "S2 [a=1]" in res.aborted and "illegal memory access" in res.aborted
    assert res.scenarios[0].winner is False and res.scenarios[0].rows  # S1's phase B and final never ran
    paths = report.write(res, tmp_path)
    assert "Stopped early" in paths[0].read_text()
    assert json.loads(paths[1].read_text())["aborted"] == res.aborted


def test_compile_workers_fall_back_to_the_main_process(tiny):
    """Without a GPU a worker cannot build CUDA inputs: it answers "not compiled" and the candidate runs
    (and compiles) in the main process. Also checks that scenarios and candidates travel to a spawned worker."""
    s = suite.Scenario("tp8", 4, "fp8_tensor")
    cands = [{"block_n": 32}, {"block_n": 64}]
    c = Compiler(OPS["moe"], jobs=1)
    try:
        c.submit(s, cands)
        assert [c.status(s, x, timeout=300) for x in cands] == [None, None]
    finally:
        c.close()
    off = Compiler(OPS["moe"], jobs=0)
    off.submit(s, cands)
    assert off.status(s, cands[0]) is None and not off.futures


class CrashOp(FakeOp):
    """Its compile jobs kill the worker process."""

    def make_inputs(self, s, layer, device):
        import os

        os._exit(3)


CRASH_OP = CrashOp()


def test_a_crashing_compile_worker_does_not_end_the_run():
    """A worker that dies: its batch is resubmitted once, one candidate per job, to a fresh pool; a second
    crash marks the outstanding candidates as errors and stops using workers."""
    s = FakeScenario("S1")
    cands = [{"a": 1, "b": 2, "c": 2}, {"a": 3, "b": 2, "c": 2}]
    c = Compiler(f"{__name__}:CRASH_OP", jobs=2)
    try:
        c.submit(s, cands)
        got = [c.status(s, x, timeout=300) for x in cands]
    finally:
        c.close()
    assert c.restarts == 2 and not c.enabled
    assert all(g is not None and g.startswith("error: compile workers crashed") for g in got)
    later = {"a": 4, "b": 2, "c": 2}
    c.submit(s, [later])  # later candidates compile in the main process
    assert c.status(s, later) is None and not c.futures


# ---- MoE end to end (interpreter) ---------------------------------------------------------------------

def _faster(monkeypatch, fast: dict):
    """Stub timing: the bench's functions need CUDA; run every layer's callable, then report 100 µs, or
    80 µs for the candidate `fast` (read from the config the call ran with)."""
    seen = []
    real = tmoe.common.ours

    def ours(s, overrides=None, **kw):
        prep = real(s, overrides, **kw)

        def prepare(x):
            fn = prep(x)

            def call():
                seen.append(overrides)
                return fn()
            return call
        return prepare

    def timed(fns, *a, **k):
        seen.clear()
        for f in fns:
            f()
        return 80.0 if seen and all(b == fast for b in seen) else 100.0

    monkeypatch.setattr(tmoe.common, "ours", ours)
    monkeypatch.setattr(timing, "profiler_kernel_time_us", timed)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier (the kernels through the interpreter on tiny CPU cases); the GPU "
                    "tier runs every `hpcops tune <op> --smoke` for real (scripts/gpu_check.sh smoke)")
def test_tune_moe_smoke_end_to_end(tiny, monkeypatch, tmp_path, capsys):
    """`hpcops tune moe --smoke` on the CPU: the heuristic and one move, each gated against the suite's
    reference through the interpreter; the faster one (stub) is written as a tuned entry."""
    op = get_op("moe")
    s = op.scenarios(False)[0]
    moved = [c for _, c in phase_a(op, s, Limits.of(False, True))][1]
    _faster(monkeypatch, moved)
    assert main(["tune", "moe", "--smoke", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| B4-tp8-fp8t |" in out and "winner" in out
    res = json.loads((tmp_path / "moe_tune.json").read_text())
    sc = res["scenarios"][0]
    assert sc["name"] == "B4-tp8-fp8t" and sc["layers"] == 2 and sc["winner"]
    moved_label = label(moved, op.base(s))
    assert [r["status"] for r in sc["rows"]] == ["ok", "ok"] and sc["best"] == moved_label
    table = json.loads((tmp_path / "moe_tuned.json").read_text())
    assert table["device"] == "cpu" and table["measured"] == [[8, 8, 256, 128, "fp8_tensor", 4]]
    (e,) = table["entries"]
    assert e["config"] == moved and e["us"] == 80.0 and e["heuristic_us"] == 100.0 and e["T"] == 4
    assert f"**{moved_label}" in (tmp_path / "moe_tune.md").read_text()


def test_gate_rejects_a_wrong_candidate(tiny, monkeypatch):
    """A candidate whose output is off fails the suite's own gate (_assert_matches): reported, never the
    winner, though its (stubbed) time is the best."""
    op = get_op("moe")
    s = op.scenarios(False)[0]
    moved = [c for _, c in phase_a(op, s, Limits.of(False, True))][1]
    real = tmoe.common.ours

    def ours(s_, overrides=None, **kw):
        prep = real(s_, overrides, **kw)
        if overrides == moved:
            return lambda x: (lambda: prep(x)().mul_(1.1))  # 10 % off: the cosine is still 1, the errors not
        return prep
    monkeypatch.setattr(tmoe.common, "ours", ours)
    monkeypatch.setattr(timing, "profiler_kernel_time_us", lambda fns, *a, **k: [f() for f in fns] and 50.0)
    res = tune(op, TuneOptions(smoke=True, layers=1, progress=False))
    h, bad = res.scenarios[0].rows
    assert h.status == "ok" and bad.status.startswith(f"check-failed: hpcops[{label(moved, op.base(s))}]")
    assert res.scenarios[0].best is h and not res.scenarios[0].winner



def _tiny_case(name: str):
    from hpcops.bench.suites import decode as sd
    from hpcops.bench.suites import prefill as sp
    from hpcops.bench.suites import rope as sr
    from hpcops.bench.tune.prefill import PrefillCase

    return {"decode": sd.Scenario("2x100", 4, 2, True), "rope": sr.Scenario(5, 4, 2, True),
            "prefill": PrefillCase(sp.Scenario("q40", 4, 2, True), False),
            "prefill-fp8q": PrefillCase(sp.Scenario("q40", 4, 2, True), True)}[name]


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier (the kernels through the interpreter on tiny CPU cases); the GPU "
                    "tier runs every `hpcops tune <op> --smoke` for real (scripts/gpu_check.sh smoke)")
@pytest.mark.parametrize("name", ["decode", "rope", "prefill", "prefill-fp8q"])
def test_other_ops_gate_their_candidates(name):
    """The decode/rope/prefill candidates run and pass their gates on a tiny case (interpreter), each inside
    its op's context (decode: the process-wide DecodeConfig, restored after)."""
    from hpcops.attention import decode as dec

    op = get_op(name.split("-")[0])
    s = _tiny_case(name)
    x = op.make_inputs(s, 0, "cpu")
    cands = [c for _, c in phase_a(op, s, Limits.of(False, False))]
    before = dec._CONFIG
    for c in cands[:3] + cands[-2:]:
        with op.context(c):
            op.gate(s, x, c, label(c, cands[0]))
            assert op.prepare(s, c)(x)() is not None
    assert before == dec._CONFIG


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier (the kernels through the interpreter on tiny CPU cases); the GPU "
                    "tier runs every `hpcops tune <op> --smoke` for real (scripts/gpu_check.sh smoke)")
def test_gate_of_a_rope_candidate_checks_its_config(monkeypatch):
    """Inside its context the suite's gate (which passes no config) runs the candidate's config."""
    from hpcops.rope import prologue

    op = get_op("rope")
    s = _tiny_case("rope")
    x = op.make_inputs(s, 0, "cpu")
    seen, real = [], prologue.rope_norm_store_kv
    record = lambda *a, **kw: seen.append(kw.get("config")) or real(*a, **kw)
    monkeypatch.setattr(prologue, "rope_norm_store_kv", record)
    cand = {**op.base(s), "block_t": 2, "num_warps": 2, "cos_sin_smem": True}
    with op.context(cand):
        op.gate(s, x, cand, "bt2")
    assert seen == [prologue.RopeConfig(2, 2, None, True)]
    assert prologue.rope_norm_store_kv is not real  # the recorder is back, the candidate's default gone


def test_tune_rope_smoke_end_to_end(monkeypatch, tmp_path, fake_timing):
    """`hpcops tune rope --smoke` on the CPU (tiny scenario, graph timing stubbed): no tuned table, a report."""
    op = get_op("rope")
    monkeypatch.setattr(type(op), "scenarios", lambda self, quick: [_tiny_case("rope")])
    monkeypatch.setattr(timing, "graph_time_us", lambda fns, *a, **k: [f() for f in fns] and 7.0)
    assert main(["tune", "rope", "--smoke", "--out", str(tmp_path), "--no-progress"]) == 0
    res = json.loads((tmp_path / "rope_tune.json").read_text())
    (sc,) = res["scenarios"]
    assert sc["name"] == "h4x2-fp8-T5" and [r["status"] for r in sc["rows"]] == ["ok", "ok"]
    assert sc["heuristic_us"] == 7.0 and not sc["winner"] and not (tmp_path / "moe_tuned.json").exists()
    assert "| h4x2-fp8-T5 | 7.0 |" in (tmp_path / "rope_tune.md").read_text()

# ---- the tuned table ---------------------------------------------------------------------------------

def _entry(T, us=10.0, **cfg):
    return {"E": 192, "E_local": 192, "H": 4096, "I": 192, "quant": "fp8_tensor", "T": T,
            "config": {f: cfg.get(f, getattr(MoeConfig(), f)) for f in TUNABLE}, "us": us, "heuristic_us": 12.0}


def test_tuned_table_round_trip(tmp_path, monkeypatch):
    import hpcops.moe.tuned as tuned

    path = tmp_path / "tuned.py"
    shutil.copy(tmoe.table_path(), path)
    doc = path.read_text().split("TUNED")[0]
    n = tmoe.merge_table(path, H200, [_entry(64, block_n=64), _entry(4, block_n=16, prequant_x=True)],
                         measured=[[192, 192, 4096, 192, "fp8_tensor", 4], [192, 192, 4096, 192, "fp8_tensor", 64]])
    assert n == 2
    text = path.read_text()
    assert text.startswith(doc) and max(len(line) for line in text.splitlines()) <= 120
    ns: dict = {}
    exec(compile(text, str(path), "exec"), ns)  # the file is valid Python and its literal is the table
    assert ns["TUNED"] == tmoe.read_table(path)
    assert [e["T"] for e in ns["TUNED"][H200]] == [4, 64]  # sorted by shape, then batch
    monkeypatch.setattr(tuned, "TUNED", ns["TUNED"])
    monkeypatch.delenv("HPCOPS_MOE_TUNED", raising=False)
    look = dict(num_experts=192, num_local_experts=192, hidden=4096, inter=192, quant="fp8_tensor")
    got = tuned_entry(H200, num_tokens=5, **look)
    assert got["block_n"] == 16 and got["prequant_x"] is True and set(got) == set(TUNABLE)
    assert tuned_entry(H200, num_tokens=48, **look)["block_n"] == 64
    # re-tuned: T=4 replaced, T=64 measured again without a winner (dropped), another device untouched
    tmoe.merge_table(path, "NVIDIA H100", [_entry(16)], measured=[])
    n = tmoe.merge_table(path, H200, [_entry(4, block_n=32)], measured=[[192, 192, 4096, 192, "fp8_tensor", 64]])
    table = tmoe.read_table(path)
    assert n == 1 and [(e["T"], e["config"]["block_n"]) for e in table[H200]] == [(4, 32)]
    assert [e["T"] for e in table["NVIDIA H100"]] == [16]
    assert tmoe.format_table(table) in path.read_text()  # stable: formatting the parsed table again is a no-op
    with pytest.raises(ValueError, match="not tunable"):
        tmoe.merge_table(path, H200, [{**_entry(4), "config": {"blk": 3}}], measured=[])


def test_merge_json_and_the_pinned_heuristic(tmp_path):
    """--merge FILE: a GPU run's moe_tuned.json into the table. Entries: a shape with a winner at one batch
    pins the heuristic's config at its other measured batches."""
    from hpcops.bench.tune.engine import Row, ScenarioResult, TuneResult

    def sres(t, winner):
        params = {"E_global": 192, "E_local": 192, "H": 4096, "I": 192, "quant": "fp8_tensor", "B": t}
        h = Row("heuristic", "A", {"block_n": 32}, "ok", 10.0, [10.0])
        b = Row("block_n=64", "A", {"block_n": 64}, "ok", 8.0 if winner else 9.9, [8.0 if winner else 9.9])
        return ScenarioResult(f"B{t}", params, h.config, 8, [h, b], best=b, winner=winner)

    res = TuneResult("moe", "kernels", 0.03, H200, [sres(4, True), sres(64, False)])
    es, measured, notes = tmoe.entries(res)
    assert [(e["T"], e["config"]["block_n"], e["us"]) for e in es] == [(4, 64, 8.0), (64, 32, 10.0)]
    assert notes["B64"].startswith("heuristic (pinned") and notes["B4"] == "winner" and len(measured) == 2
    no_win = TuneResult("moe", "kernels", 0.03, H200, [sres(64, False)])
    assert tmoe.entries(no_win)[0] == []
    path = tmp_path / "tuned.py"
    shutil.copy(tmoe.table_path(), path)
    js = tmp_path / "moe_tuned.json"
    js.write_text(json.dumps(tmoe.tuned_json(res)))
    assert tmoe.merge_json(js, path) == (H200, 2, 2)
    js.write_text(json.dumps({**tmoe.tuned_json(res), "device": "cpu"}))
    with pytest.raises(ValueError, match="no GPU device"):
        tmoe.merge_json(js, path)


def test_cli_usage(capsys, monkeypatch):
    assert main(["tune", "nope", "--dry-run"]) == 2
    assert "unknown op 'nope'" in capsys.readouterr().err
    assert main(["tune", "decode", "--dry-run", "--knobs", "nope"]) == 2
    err = capsys.readouterr().err
    assert "names no knob of decode" in err and "task_cost" in err
    # --knobs: only the moves of knobs whose fields are all named (here the plan's cost model)
    assert main(["tune", "decode", "--dry-run", "--knobs", "task_cost,min_tiles", "--only", "64x4K h8/1 fp8"]) == 0
    moves = [ln.split()[1:] for ln in capsys.readouterr().out.splitlines() if ln.startswith("  A ")]
    assert moves and all(f.split("=")[0] in ("task_cost", "min_tiles") for m in moves for f in m)
    assert ["task_cost=0"] in moves
    assert main(["tune", "rope", "--write"]) == 2
    assert "no tuned table" in capsys.readouterr().err
    assert set(OPS) == {"moe", "moe-shapes", "decode", "decode-grid", "rope", "prefill", "prefill-gluon"}
    # decode-grid: the decode knobs over the grid's cases (no plan-launch moves), picked by name
    assert main(["tune", "decode-grid", "--dry-run", "--only", "p16", "--knobs", "lean_pages,lean_loop"]) == 0
    out = capsys.readouterr().out
    moves = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("  A ")]
    assert ["lean_pages=0"] in moves and ["lean_loop=0"] in moves and not any("plan_" in f for m in moves for f in m)


def test_prefill_gluon_tunes_bf16_and_fp8_q_on_its_kernels():
    """`hpcops tune prefill-gluon`: the bf16 scenarios and the fp8-q ones over fp8 KV (never a bf16 q over fp8 KV,
    which the Gluon kernels do not take); an fp8 scenario starts from the warp-specialized tile and keeps only
    warp-specialized candidates whose shared memory (with the Vᵀ and P buffers) fits."""
    from hpcops.attention.prefill import GLUON_SMEM_BYTES, gluon_smem_bytes

    op = get_op("prefill-gluon")
    scen = op.scenarios(False)
    assert {(c.s.fp8, c.fp8_q) for c in scen} == {(False, False), (True, True)}
    fp8 = next(c for c in scen if c.fp8_q and c.s.spec == "q512")  # few tiles: 64-row tiles for a 16-bit q
    base = op.base(fp8)
    assert (base["block_m"], base["num_warps"], base["gluon_ws"], base["gluon"]) == (128, 8, True, True)
    assert op.valid(fp8, base)
    assert not op.valid(fp8, {**base, "gluon_ws": False})
    # four K/V buffers fit (196608 bytes) with the 4-byte output stores, not beside the 16-byte ones' 16 KB scratch
    assert base["gluon_wide_store"] and not op.valid(fp8, {**base, "num_stages": 4})
    assert op.valid(fp8, {**base, "num_stages": 4, "gluon_wide_store": False})
    # the fp8 default sums its rows on the tensor cores, which P in registers cannot; the 16-bit kernel never
    # and runs persistent with its producer prefetching q, which P in registers cannot either
    assert base["gluon_mma_sum"] and not op.valid(fp8, {**base, "gluon_p_regs": True})
    assert base["gluon_prefetch"] and not op.valid(fp8, {**base, "gluon_p_regs": True, "gluon_mma_sum": False})
    # nor does the byte-permute transpose, whose P order is the permuted one in shared memory
    p_regs = {**base, "gluon_p_regs": True, "gluon_mma_sum": False, "gluon_persist": False, "gluon_prefetch": False}
    assert base["gluon_vt_prmt"] and not op.valid(fp8, p_regs)
    assert op.valid(fp8, {**p_regs, "gluon_vt_prmt": False})
    assert gluon_smem_bytes(128, 128, 4, 128, 1, True) == 196608 <= GLUON_SMEM_BYTES
    # gluon_vt3's third Vᵀ buffer (16 KB at the default tile) fits beside 3 K/V buffers and the prefetch, not 4
    three = gluon_smem_bytes(128, 128, 3, 128, 1, True, vt_bufs=3)
    assert three == gluon_smem_bytes(128, 128, 3, 128, 1, True) + 16384
    assert op.valid(fp8, {**base, "gluon_vt3": True})
    assert not op.valid(fp8, {**base, "gluon_vt3": True, "num_stages": 4})
    assert not op.valid(fp8, {**base, "block_n": 64})  # the byte-permute transpose needs 128-key tiles
    assert op.valid(fp8, {**base, "block_n": 64, "gluon_vt_prmt": False})
    knob = next(k for k in op.space if "gluon_vt_prmt" in k.fields and "block_n" in k.fields)  # which moves both
    assert knob.options(base, fp8) == ((64, False), (128, True))
    bf16 = next(c for c in scen if not c.fp8_q and c.s.spec == "q8k")
    assert not op.valid(bf16, {**op.base(bf16), "num_stages": 4})  # 294912 bytes of bf16 tiles
    assert not op.valid(bf16, {**op.base(bf16), "gluon_mma_sum": True})


def test_prefill_tune_candidates_do_not_gate_themselves_when_prepared(monkeypatch):
    """The tuner gates its candidates (`gate`) and compiles them in workers that launch nothing (an output left
    NaN): preparing a candidate must not run the bench variants' own layer-0 check, which failed every candidate
    of `tune prefill-gluon` on the H200 in session 29; the bench's variant rows still run it."""
    from hpcops.bench.suites import prefill as suite

    def boom(*a, **k):
        raise AssertionError("variant check ran")

    monkeypatch.setattr(suite, "_check_variant", boom)
    op = get_op("prefill-gluon")
    case = next(c for c in op.scenarios(False) if c.fp8_q and c.s.hq == 8 and c.s.spec == "q512")
    x = suite._make_inputs(case.s, 0, "cpu")
    assert x["layer"] == 0
    assert callable(op.prepare(case, op.base(case))(x))  # built, not run, not checked
    with pytest.raises(AssertionError, match="variant check ran"):
        suite._ours(True, {**suite.GLUON_FP8, "gluon_tree": True})(x)
