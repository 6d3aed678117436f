"""The decode generality grid (`hpcops bench decode --grid`, suite decode-grid) without a GPU: its case list,
the quick subset, the CLI wiring, the per-case verdicts on fake rows, the peer fallback from FlashInfer to
vLLM's unified attention, and the gates on tiny shapes through the interpreter."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch

from hpcops.bench import report
from hpcops.bench.registry import SUITES, Impl, PeerUnavailable
from hpcops.bench.runner import Row, SuiteResult
from hpcops.bench.suites import decode_grid as grid

AXES = {"gqa": (1, 4, 5, 8, 16), "d": (64, 128, 256), "page": (16, 32, 64), "kv": ("bf16", "fp8"),
        "lengths": ("short", "long", "256K", "logmix")}


@pytest.fixture
def tiny(monkeypatch):
    """Lengths at interpreter sizes (the grid's shapes otherwise unchanged)."""
    monkeypatch.setitem(grid.LENGTHS, "short", "3x70")
    monkeypatch.setitem(grid.LENGTHS, "long", "2x200")
    monkeypatch.setitem(grid.LENGTHS, "256K", "1x300+2x20")
    monkeypatch.setattr(grid, "LOGMIX", (5, 300))
    return grid


@pytest.fixture
def hermetic_peers(monkeypatch):
    """Leave sys.path and sys.modules as they were: importing the vendored vLLM kernels puts `.peers` on the
    path, and later tests check what happens when they are not vendored."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "vllm_kernels" and n not in before]:
        del sys.modules[name]


def test_grid_covers_every_axis_value_with_several_others():
    cases = grid.grid()
    assert 40 <= len(cases) <= 70 and len({c.name for c in cases}) == len(cases)
    assert {c.key for c in cases} >= {(8, 1, 128, 64, kv, n) for kv in AXES["kv"] for n in AXES["lengths"]}
    for axis, values in AXES.items():
        seen = Counter(getattr(c, axis) for c in cases)
        assert set(seen) == set(values), axis
        for v in values:  # each value with at least two values of two other axes
            mine = [c for c in cases if getattr(c, axis) == v]
            assert len(mine) >= 4, (axis, v)
            varied = [a for a in AXES if a != axis and len({getattr(c, a) for c in mine}) >= 2]
            assert len(varied) >= 2, (axis, v, varied)
    assert all(c.hq % c.hkv == 0 and c.hkv in (1, 8) for c in cases)
    long_one = [c for c in cases if c.lengths == "256K"]
    assert long_one and all(max(c.lens) == 256 * 1024 for c in long_one)


def test_quick_is_a_covering_subset():
    quick = grid.scenarios(quick=True)
    full = {c.key for c in grid.grid()}
    assert len(quick) == len(grid.QUICK) == 12 and {c.key for c in quick} <= full
    for axis, values in AXES.items():
        assert {getattr(c, axis) for c in quick} == set(values), axis


def test_logmix_is_seeded_and_the_layer_suites():
    from hpcops.bench.suites.layer import context_lens

    c = grid.GridCase(8, 1, 128, 64, "bf16", "logmix")
    assert c.lens == c.lens == context_lens("logmix", 32) and len(c.lens) == 32
    assert all(grid.LOGMIX[0] <= n <= grid.LOGMIX[1] for n in c.lens)


def test_cases_rows_and_commands():
    cases = list(grid.cases({"quick": True}))
    fp8 = next(c for c in cases if c.params["kv"] == "fp8")
    bf16 = next(c for c in cases if c.params["kv"] == "bf16")
    assert [i.name for i in fp8.impls] == ["hpcops-fp8q", "hpcops", "hpcops-gluon", "flashinfer-decode",
                                           "flashinfer-tc", "vllm-unified"]
    assert [i.name for i in bf16.impls] == ["hpcops", "hpcops-gluon", "flashinfer-decode", "flashinfer-tc",
                                            "vllm-unified"]
    assert all(i.timing == "graph" for c in cases for i in c.impls)
    assert fp8.command == f"hpcops bench decode --grid --only '{fp8.name}'"
    assert SUITES["decode-grid"] == "hpcops.bench.suites.decode_grid"


def test_cli_grid_runs_the_grid_suite(monkeypatch, tmp_path, capsys):
    import hpcops.bench
    from hpcops.cli import main

    calls = []

    def fake_run(name, opts, **kw):
        calls.append((name, dict(opts), kw["only"]))
        return SuiteResult(name, [], {"gpu": "test"})

    monkeypatch.setattr(hpcops.bench, "run_suite", fake_run)
    assert main(["bench", "decode", "--grid", "--quick", "--only", "h8/1", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    assert calls == [("decode-grid", {"quick": True}, "h8/1")]
    assert (tmp_path / "decode-grid.md").is_file() and not (tmp_path / "decode.md").exists()
    assert main(["bench", "moe", "--grid"]) == 2
    assert "--grid applies to decode" in capsys.readouterr().err


def test_bench_all_leaves_the_grid_out(monkeypatch, tmp_path):
    import hpcops.bench
    from hpcops.cli import main

    names = []
    monkeypatch.setattr(hpcops.bench, "run_suite",
                        lambda name, opts, **kw: names.append(name) or SuiteResult(name, [], {}))
    assert main(["bench", "all", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "decode" in names and "decode-grid" not in names


def _rows(case, kv, **us):
    """Fake rows of one case: impl=µs (None: unavailable); bytes 4e6, so 1 µs = 4000 GB/s."""
    out = []
    for impl, t in us.items():
        impl = impl.replace("_", "-")
        status = "ok" if t is not None else "unavailable: flashinfer-decode cannot run this case: group size 5"
        if isinstance(t, str):
            status, t = t, None
        out.append(Row("decode-grid", case, impl, impl.startswith("hpcops"), t, status, bytes=4 * 10**6,
                       params=dict(kv=kv, gqa=8, d=128, page=64, lengths="long", group="base")))
    return out


def _fake_result():
    rows = (_rows("a", "bf16", hpcops=10.0, flashinfer_decode=30.0, flashinfer_tc=10.5, vllm_unified=20.0)
            + _rows("b", "bf16", hpcops=2.1, flashinfer_decode=2.0, flashinfer_tc=None, vllm_unified=5.0)
            + _rows("c", "bf16", hpcops=10.5, flashinfer_decode=10.0, flashinfer_tc=None, vllm_unified=None)
            + _rows("d", "fp8", hpcops_fp8q=8.0, hpcops=9.0, flashinfer_decode=None, flashinfer_tc=None,
                    vllm_unified=12.0)
            + _rows("e", "bf16", hpcops=5.0, flashinfer_decode="check-failed: flashinfer-decode: max err",
                    flashinfer_tc=None, vllm_unified=4.0)
            + _rows("f", "fp8", hpcops_fp8q="check-failed", hpcops=9.0, flashinfer_decode=None,
                    flashinfer_tc=None, vllm_unified="unavailable: vllm_kernels is not vendored"))
    return SuiteResult("decode-grid", rows, {"gpu": "test", "copy_gbps": 2000.0})


def test_summary_picks_the_peer_and_applies_the_targets():
    s = {x["case"]: x for x in grid.summarize(_fake_result())}
    assert (s["a"]["peer"], s["a"]["ratio"], s["a"]["verdict"]) == ("flashinfer-tc", 1.05, "pass")
    # peer at 2000 GB/s = 100 % of copy: 0.95× is enough
    assert (s["b"]["peer"], s["b"]["need"], s["b"]["verdict"]) == ("flashinfer-decode", 0.95, "pass")
    assert s["b"]["peer_pct_copy"] == pytest.approx(100.0)
    # peer at 400 GB/s: 1.0× needed, 0.95× is short
    assert (s["c"]["need"], s["c"]["verdict"]) == (1.0, "short") and s["c"]["ratio"] == pytest.approx(10 / 10.5)
    # FlashInfer unavailable: vllm-unified; on fp8 KV our fp8-q row counts
    assert (s["d"]["peer"], s["d"]["ours"], s["d"]["ratio"]) == ("vllm-unified", "hpcops-fp8q", 1.5)
    assert "group size 5" in s["d"]["why"]
    # a FlashInfer row that failed its gate is no peer either
    assert (s["e"]["peer"], s["e"]["verdict"]) == ("vllm-unified", "short") and "check-failed" in s["e"]["why"]
    assert (s["f"]["peer"], s["f"]["ours"], s["f"]["verdict"]) == (None, None, "—")


def test_summary_markdown_and_reports(tmp_path):
    res = _fake_result()
    md = report.markdown(res)
    assert md.index("## Targets (issue 10, deliverable 3)") > md.index("| case | impl |")  # after the table
    assert "| a | 8 | 128 | 64 | bf16 | long | hpcops | 10.0 | flashinfer-tc | 10.5 | 19% | 1.05 | 1.00 | pass |" in md
    assert ("| b | 8 | 128 | 64 | bf16 | long | hpcops | 2.1 | flashinfer-decode | 2.0 | 100% | 0.95 | 0.95 | pass |"
            in md)
    assert "**3 pass, 2 short, 1 without a verdict** of 6 cases." in md
    assert "Short:\n\n- c: 0.95× flashinfer-decode (need 1.00)\n- e: 0.80× vllm-unified (need 1.00)\n" in md
    assert "- d: FlashInfer cannot: flashinfer-decode: unavailable" in md
    assert "Against vllm-unified: 2 cases" in md
    paths = report.write(res, tmp_path)
    assert {p.name for p in paths} >= {"decode-grid.json", "decode-grid.md"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "decode-grid.png").stat().st_size > 0
    assert "## Targets" not in report.markdown(SuiteResult("decode", res.rows, res.machine))  # other suites


def test_merge_joins_split_runs(tmp_path):
    res = _fake_result()
    first = SuiteResult("decode-grid", [r for r in res.rows if r.case in "abc"], res.machine)
    second = SuiteResult("decode-grid", [r for r in res.rows if r.case in "cdef"], {"gpu": "other"})
    second.rows[0].us = 9.0  # case c again, measured later: it wins
    report.write(first, tmp_path / "A")
    report.write(second, tmp_path / "B")
    report.merge("decode-grid", [tmp_path / "A", tmp_path / "B"], tmp_path / "all")
    back = report.load(tmp_path / "all" / "decode-grid.json")
    assert list(report.by_case(back)) == list("abcdef") and back.machine["gpu"] == "test"
    assert next(r for r in back.rows if r.case == "c" and r.impl == "hpcops").us == 9.0


def test_merge_command_line(tmp_path, capsys):
    """`python -m hpcops.bench.report SUITE OUT RUN...`: the same join; a usage error (exit 2) without arguments or
    for a run folder without the suite's JSON."""
    res = _fake_result()
    report.write(res, tmp_path / "A")
    assert report.main(["decode-grid", str(tmp_path / "all"), str(tmp_path / "A")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert list(report.by_case(report.load(tmp_path / "all" / "decode-grid.json"))) == list("abcdef")
    for argv in ([], ["decode-grid", str(tmp_path / "x"), str(tmp_path / "missing")]):
        with pytest.raises(SystemExit) as e:
            report.main(argv)
        assert e.value.code == 2
    assert "no decode-grid.json in" in capsys.readouterr().err


def test_a_peer_that_raises_is_unavailable_and_vllm_takes_over(monkeypatch, tiny, device):
    """FlashInfer (absent here, or made to fail like an unsupported GQA) is `unavailable` with its error, a
    peer with a wrong output is `check-failed`; the summary then compares with vllm-unified."""
    from hpcops.bench import runner, timing
    from hpcops.bench.registry import Case

    monkeypatch.setattr(timing, "graph_time_us", lambda fns: 10.0)
    c = grid.GridCase(10, 2, 64, 16, "bf16", "short")
    x = grid.make_inputs(c, 0, device)
    case = Case("decode-grid", c.name, make_inputs=lambda layer: x, impls=[])

    def unsupported(x):
        raise RuntimeError("BatchDecodeWithPagedKVCache failed: Unsupported group_size: 5\n(more)")

    def wrong(x):
        return lambda: x["out"].zero_()

    fi = Impl("flashinfer-decode", grid.gated_peer("flashinfer-decode", unsupported))
    status, us = runner._run_impl(case, fi, [x], True)
    assert us is None and status == ("unavailable: flashinfer-decode cannot run this case: RuntimeError: "
                                     "BatchDecodeWithPagedKVCache failed: Unsupported group_size: 5")
    status, _ = runner._run_impl(case, Impl("flashinfer-tc", grid.gated_peer("flashinfer-tc", wrong)), [x], True)
    assert status.startswith("check-failed: flashinfer-tc")
    absent = Impl("peer", grid.gated_peer("peer", lambda x: (_ for _ in ()).throw(PeerUnavailable("not here"))))
    assert runner._run_impl(case, absent, [x], True) == ("unavailable: not here", None)
    rows = [Row("decode-grid", c.name, "hpcops", True, 9.0, "ok", params={"kv": "bf16"}),
            Row("decode-grid", c.name, "flashinfer-decode", False, None, status),
            Row("decode-grid", c.name, "vllm-unified", False, 10.0, "ok")]
    peer, why = grid.select_peer(rows)
    assert peer.impl == "vllm-unified" and why.startswith("FlashInfer cannot: flashinfer-decode: check-failed")


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gate_passes_for_ours_on_a_tiny_case(tiny, kv, device):
    c = grid.GridCase(10, 2, 64, 16, kv, "long")
    x = grid.make_inputs(c, 0, device)
    grid.check(x)
    assert ("reference_fp8q" in x) == (kv == "fp8")
    bad = dict(x, reference=torch.zeros_like(x["out"]))  # a reference ours cannot match: the gate fails
    with pytest.raises(AssertionError, match="hpcops"):
        grid.check(bad)


def _vllm_or_skip():
    try:
        return grid.import_vendored(grid.VLLM_MODULE, how="")
    except PeerUnavailable as exc:
        pytest.skip(f"vLLM's kernels are not vendored into .peers/ ({exc})"[:200])


# vLLM's 2D kernel divides its padded (masked-out) query rows by a zero sum; numpy warns under the interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("kv,split", [("bf16", True), ("fp8", True), ("bf16", False)])
def test_vllm_unified_matches_the_reference(tiny, hermetic_peers, monkeypatch, kv, split, device):
    """The vLLM adapter on a tiny GQA-5 d64 page-16 case, through its split-KV (3D) path and, with vLLM's
    2D threshold shrunk below the batch, its 2D path; the gate inside `prepare` compares with the reference."""
    _vllm_or_skip()
    if not split:
        monkeypatch.setattr(grid, "VLLM_GRID_2D", 2)  # 2 // Hkv 2 = 1 < B 3: the 2D kernel
    c = grid.GridCase(10, 2, 64, 16, kv, "short")
    x = grid.make_inputs(c, 0, device)
    fn = grid.gated_peer(grid.VLLM, grid.vllm_unified)(x)  # raises AssertionError on a wrong output
    x["out"].fill_(float("nan"))
    fn()
    grid.assert_close(grid.reference(x), x["out"], name="vllm-unified")


def test_suite_runs_through_the_runner(tiny, hermetic_peers, monkeypatch, device):
    """One quick case end to end through the real runner and adapters (inputs on the test's device, each timed
    call run once): our rows pass the gate and are timed (the Gluon row where its kernel applies: an sm_90 GPU);
    FlashInfer, absent here, is unavailable; the verdict is then against vllm-unified (or no verdict when vLLM's
    kernels are not vendored)."""
    from hpcops.bench import runner, timing

    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed: this test covers the fallback")
    real = grid.make_decode_inputs
    monkeypatch.setattr(grid, "make_decode_inputs", lambda *a, **kw: real(*a, **{**kw, "device": device}))
    monkeypatch.setattr(runner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "graph_time_us", lambda fns, **kw: [fn() for fn in fns] and 10.0)
    res = runner.run_suite("decode-grid", {"quick": True, "layers": 1}, only="h16/1 d128 p64 fp8",
                           progress=False, machine={"gpu": "cpu", "copy_gbps": 1000.0})
    status = {r.impl: r.status for r in res.rows}
    assert [r.case for r in res.rows][0] == "3x70 h16/1 d128 p64 fp8" and len(res.rows) == 6
    assert status["hpcops-fp8q"] == status["hpcops"] == "ok"
    # the Gluon decode runs this fp8 case on an sm_90 GPU; elsewhere its row says why not
    from hpcops.attention import decode as dec

    why = dec._hopper(device)
    if why is None:
        assert status["hpcops-gluon"] == "ok"
    else:
        assert status["hpcops-gluon"] == f"unavailable: the Gluon kernel does not apply here: {why}"
    assert status["flashinfer-decode"].startswith("unavailable: flashinfer not importable")
    (s,) = grid.summarize(res)
    if status["vllm-unified"] == "ok":
        assert (s["peer"], s["ours"], s["ratio"], s["verdict"]) == ("vllm-unified", "hpcops-fp8q", 1.0, "pass")
    else:
        assert status["vllm-unified"].startswith("unavailable") and s["verdict"] == "—"


def test_bench_no_clock_reaches_the_runner(monkeypatch, tmp_path):
    """`hpcops bench --no-clock`: run_suite is asked not to sample the SM clock (by default it is)."""
    import hpcops.bench
    from hpcops.cli import main

    seen = []
    monkeypatch.setattr(hpcops.bench, "run_suite",
                        lambda name, opts, **kw: seen.append(kw["clocks"]) or SuiteResult(name, [], {}))
    assert main(["bench", "rope", "--out", str(tmp_path), "--no-progress"]) == 0
    assert main(["bench", "rope", "--out", str(tmp_path), "--no-progress", "--no-clock"]) == 0
    assert seen == [True, False]
