"""The benchmark harness pieces that run without a GPU: scenario grammar, registry, reports, the
bandwidth-reference copy kernel, and the demo's schedule arithmetic against the real plan."""

from __future__ import annotations

import json

import pytest
import torch

from hpcops.bench import report
from hpcops.bench.registry import get_suite
from hpcops.bench.runner import Row, SuiteResult
from hpcops.bench.scenarios import DECODE_SCENARIOS, parse_lengths


def test_parse_lengths():
    assert parse_lengths("1x128K+31x4K") == [131072] + [4096] * 31
    assert parse_lengths("32x0.125K+2x7") == [128] * 32 + [7, 7]
    assert parse_lengths("5,6,700") == [5, 6, 700]
    with pytest.raises(ValueError, match="bad length spec"):
        parse_lengths("3y4K")
    assert all(parse_lengths(s) for s in DECODE_SCENARIOS)


def test_unknown_suite():
    with pytest.raises(ValueError, match="unknown bench suite"):
        get_suite("nope")


def _result():
    rows = [Row("decode", "c1", "hpcops", True, 10.0, "ok", layers=8, bytes=10**7),
            Row("decode", "c1", "hpcops-plan", True, 3.0, "ok", note="per-step"),
            Row("decode", "c1", "peer", False, 25.0, "ok", bytes=10**7),
            Row("decode", "c1", "absent", False, None, "unavailable: not installed"),
            Row("decode", "c2", "hpcops", True, None, "check-failed")]
    return SuiteResult("decode", rows, {"gpu": "test", "copy_gbps": 2000.0})


def test_report_roundtrip(tmp_path):
    paths = report.write(_result(), tmp_path)
    md = (tmp_path / "decode.md").read_text()
    assert "| c1 | peer | 25.0 | 400 | 20% |  | 2.50 | ok |" in md  # 1e7 B / 25 µs; ratio to ours
    assert "check-failed" in md and "unavailable: not installed" in md
    assert "| c1 | **hpcops-plan** | 3.0 |  |  |  |  | ok |" in md  # per-step work: no ratio
    assert "GEMM ceiling" not in md  # not measured in this result
    gemm = _result()
    gemm.machine["gemm_tflops_bf16"] = 700.0
    assert "measured bf16 GEMM ceiling 700.0 TFLOP/s" in report.markdown(gemm)
    back = report.load(paths[0])
    assert [r.us for r in back.rows] == [r.us for r in _result().rows]
    assert json.loads(paths[0].read_text())["rows"][0]["gbps"] == pytest.approx(1000.0)


def test_stream_copy_kernel(device):
    from hpcops.bench._copy_kernels import stream_copy_kernel

    src = torch.randn(10_007, device=device)
    dst = torch.full_like(src, float("nan"))
    stream_copy_kernel[(3,)](src, dst, src.numel(), BLOCK=1024)
    assert torch.equal(src, dst)


def test_demo_loads_match_the_plan():
    """The demo's host arithmetic gives the same per-program tile counts as the plan's task map."""
    from hpcops.attention import reference as ref
    from hpcops.demo import dynamic_loads

    for spec in DECODE_SCENARIOS:
        lens = parse_lengths(spec)
        plan = ref.plan_decode(torch.tensor(lens, dtype=torch.int32), num_kv_heads=1, num_programs=264,
                               min_tiles=4)
        per_prog = [0] * 264
        for prog, _h, _b, _t0, n, _split in plan.tasks():
            per_prog[prog] += n
        assert per_prog == dynamic_loads(lens, 1, 264, 4), spec


def test_per_call_us_parses_marked_calls():
    """Profiler events between consecutive markers make one call; the median of the matching sums is returned;
    overlapping events (programmatic dependent launch) count their overlap once."""
    from hpcops.bench.timing import per_call_us

    ev = [("mark", 0, 1), ("fused_moe_kernel", 1, 10), ("fill", 11, 5), ("fused_moe_kernel", 16, 4),
          ("mark", 30, 1), ("fused_moe_kernel", 31, 12), ("fused_moe_kernel", 43, 3),
          ("mark", 50, 1), ("fused_moe_kernel_x", 51, 30), ("fused_moe_kernel", 81, 6), ("mark", 90, 1)]
    assert per_call_us(ev, name_filter="fused_moe_kernel", marker="mark", calls=3) == 15.0  # 14, 15, 36
    assert per_call_us(ev, name_filter=None, marker="mark", calls=3) == 19.0  # 19, 15, 36
    # a second kernel starting 4 µs into the first, a third inside the second, a fourth alone: [1, 15) and [30, 32)
    # cover 16 µs (their durations sum to 24)
    pdl = [("mark", 0, 1), ("gate_up", 1, 10), ("down", 5, 10), ("reduce", 12, 2), ("quant", 30, 2), ("mark", 40, 1)]
    assert per_call_us(pdl, name_filter=None, marker="mark", calls=1) == 16.0
    assert per_call_us(pdl, name_filter=("gate_up", "down"), marker="mark", calls=1) == 14.0  # [1, 15)
    with pytest.raises(RuntimeError, match="delimit 3 calls, expected 4"):
        per_call_us(ev, name_filter=None, marker="mark", calls=4)
    with pytest.raises(RuntimeError, match="no device events named"):
        per_call_us(ev, name_filter="nope", marker="mark", calls=3)
    # several texts: an event matching any of them counts
    assert per_call_us(ev, name_filter=("fused_moe_kernel",), marker="mark", calls=3) == 15.0
    assert per_call_us(ev, name_filter=("nope", "fused_moe"), marker="mark", calls=3) == 15.0
    with pytest.raises(RuntimeError, match=r"\*nope\* or \*nada\*"):
        per_call_us(ev, name_filter=("nope", "nada"), marker="mark", calls=3)


def test_profile_per_call_on_cpu():
    """The profiler plumbing of profiler_kernel_time_us (events, markers, per-call sums) with CPU activity:
    on the GPU the same body runs with CUDA activity and a marker kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from hpcops.bench.timing import device_events, profile_per_call_us

    a = torch.randn(64, 64)
    i = torch.arange(4)
    calls = []
    fns = [lambda: (calls.append(0), torch.mm(a, a), torch.mm(a, a)), lambda: (calls.append(1), torch.mm(a, a))]
    us = profile_per_call_us(fns, "aten::mm", calls=3, warmup=1, marker=lambda: torch.lcm(i, i),
                             marker_name="aten::lcm", activity=ProfilerActivity.CPU, device_type=DeviceType.CPU,
                             sync=lambda: None)
    assert us > 0 and calls == [0, 1] * 4  # warmup + 3 profiled rounds, layers in order
    with pytest.raises(RuntimeError, match="no device events"):
        profile_per_call_us(fns, "aten::bmm", calls=2, warmup=0, marker=lambda: torch.lcm(i, i),
                            marker_name="aten::lcm", activity=ProfilerActivity.CPU, device_type=DeviceType.CPU,
                            sync=lambda: None)
    assert device_events([], DeviceType.CUDA) == []


def test_only_selects_any_of_its_texts():
    """--only (bench and tune): a case whose name contains the text, or any of several comma-separated ones."""
    from hpcops.bench.runner import case_selected

    names = ["h64x8-bf16-q4k", "h64x8-fp8-q8k", "h8x1-bf16-q1ks2k", "h8x1-fp8-q512"]
    assert [n for n in names if case_selected(n, None)] == names
    assert [n for n in names if case_selected(n, "fp8")] == ["h64x8-fp8-q8k", "h8x1-fp8-q512"]
    assert [n for n in names if case_selected(n, "q4k,q8k")] == names[:2]
    assert [n for n in names if case_selected(n, "ks2k,")] == ["h8x1-bf16-q1ks2k"]  # an empty text selects nothing
    assert not [n for n in names if case_selected(n, "q16k")]


def test_impls_selects_rows_by_name_or_pattern():
    """--impls: only the named rows (exact names or shell patterns, comma-separated); a case left with no row is
    dropped, the others keep their gate and order."""
    from hpcops.bench.registry import Case, Impl
    from hpcops.bench.runner import impl_selected, select_impls

    def case(name, impls):
        return Case(suite="prefill", name=name, make_inputs=lambda layer, device="cuda": None,
                    impls=[Impl(i, lambda x: (lambda: None)) for i in impls], bytes=1, check=lambda x: None)

    cases = [case("a", ["hpcops-fp8q", "hpcops-bf16kv", "hpcops-bf16kv-narrow", "flashinfer"]), case("b", ["sdpa"])]
    assert select_impls(cases, None) is cases
    kept = select_impls(cases, "hpcops-fp8q,hpcops-bf16kv*")
    assert [c.name for c in kept] == ["a"] and kept[0].check is cases[0].check
    assert [i.name for i in kept[0].impls] == ["hpcops-fp8q", "hpcops-bf16kv", "hpcops-bf16kv-narrow"]
    assert [i.name for i in cases[0].impls][-1] == "flashinfer"  # the suite's own cases are not changed
    assert impl_selected("hpcops-fp8q-narrow", "*narrow") and not impl_selected("hpcops-fp8q", "hpcops-fp8")
    assert not select_impls(cases, "nothing,")


def test_runner_times_each_impl_its_way(monkeypatch):
    """Impl.timing picks graph replay or the profiler's kernel sum (with the impl's filter); a peer whose
    own check fails is check-failed, a missing one unavailable, ours is not timed when the gate failed."""
    from hpcops.bench import runner, timing
    from hpcops.bench.registry import Case, Impl, PeerUnavailable

    seen = []
    monkeypatch.setattr(timing, "graph_time_us", lambda fns: seen.append(("graph", len(fns))) or 10.0)
    monkeypatch.setattr(timing, "profiler_kernel_time_us", lambda fns, f: seen.append(("kernels", f)) or 7.0)

    def bad(x):
        raise AssertionError("peer: cosine 0.5")

    def missing(x):
        raise PeerUnavailable("not vendored")

    ok = lambda x: (lambda: None)
    case = Case("moe", "c", make_inputs=lambda layer: layer, impls=[])
    assert runner._run_impl(case, Impl("a", ok, ours=True), [0, 1], True) == ("ok", 10.0)
    assert runner._run_impl(case, Impl("b", ok, timing="kernels", kernel_filter="k"), [0], True) == ("ok", 7.0)
    assert seen == [("graph", 2), ("kernels", "k")]
    assert runner._run_impl(case, Impl("c", ok, ours=True), [0], False) == ("check-failed", None)
    assert runner._run_impl(case, Impl("d", bad), [0], True) == ("check-failed: peer: cosine 0.5", None)
    assert runner._run_impl(case, Impl("e", missing), [0], True) == ("unavailable: not vendored", None)
    with pytest.raises(ValueError, match="timing"):
        Impl("f", ok, timing="wall")
    with pytest.raises(ValueError, match="kernel_filter"):
        Impl("g", ok, kernel_filter="k")


def test_interleaved_rounds_alternate_the_order_and_take_medians(monkeypatch):
    """`hpcops bench --rounds N`: the impls are timed round-robin, the order reversed every other round, with
    50 / N replays (at least 10) each; a row's µs is the median of its rounds; an impl that fails is not timed
    again; the runner rejects rounds < 1."""
    from hpcops.bench import runner, timing
    from hpcops.bench.registry import Case, Impl

    order, clock = [], iter(range(100))

    def fake(fns, replays=50):
        order.append((fns[0](), replays))
        return 10.0 + next(clock)  # a clock that drifts: later timings are slower

    monkeypatch.setattr(timing, "graph_time_us", fake)
    calls = {"b": 0}

    def flaky(x):  # b's own check fails in its second round
        calls["b"] += 1
        if calls["b"] == 2:
            raise AssertionError("drifted")
        return lambda: "b"

    case = Case("prefill", "c", make_inputs=lambda layer: layer,
                impls=[Impl("a", lambda x: (lambda: "a"), ours=True), Impl("b", flaky),
                       Impl("c", lambda x: (lambda: "c"))])
    steps = []
    got = runner._run_rounds(case, [0], True, 3, steps.append)
    assert [o for o, _ in order] == ["a", "b", "c", "c", "a", "a", "c"]  # b failed in round 2, skipped in round 3
    assert {r for _, r in order} == {16}  # 50 // 3 replays a timing
    assert got["a"] == ("ok", 14.0, "10.0, 14.0, 15.0")
    assert got["c"] == ("ok", 13.0, "12.0, 13.0, 16.0")
    assert got["b"][0].startswith("check-failed: drifted") and got["b"][1] is None
    assert len(steps) == 9  # every impl a round, the skipped one included (the progress bar's count)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        runner.run_suite("prefill", rounds=0)


def test_report_compares_rows_timed_alike(tmp_path):
    """Kernel-timed rows are compared with our kernel-timed row, graph-timed ones with our graph row; the
    report says how the kernel rows were timed and lists every impl's note."""
    rows = [Row("moe", "c1", "hpcops", True, 50.0, "ok"),
            Row("moe", "c1", "hpcops-kernels", True, 40.0, "ok", note="all its kernels", timing="kernels"),
            Row("moe", "c1", "vllm-triton", False, 60.0, "ok", note="its two fused_moe_kernel launches",
                timing="kernels"),
            Row("moe", "c1", "torch", False, 100.0, "ok"),
            Row("moe", "c2", "vllm-triton", False, None, "check-failed: vllm-triton: cosine 0.1", timing="kernels")]
    res = SuiteResult("moe", rows, {"gpu": "test"})
    md = report.markdown(res)
    assert "| c1 | vllm-triton | 60.0 |  |  |  | 1.50 | ok |" in md  # / hpcops-kernels, not / hpcops
    assert "| c1 | torch | 100.0 |  |  |  | 2.00 | ok |" in md
    assert "| c1 | **hpcops-kernels** | 40.0 |  |  |  |  | ok |" in md  # the kernel-timed reference row
    assert "`hpcops-kernels`, `vllm-triton` are timed otherwise" in md
    assert "- `vllm-triton`: its two fused_moe_kernel launches" in md and "- `hpcops-kernels`: all its kernels" in md
    back = report.load(report.write(res, tmp_path)[0])
    assert [r.timing for r in back.rows] == [r.timing for r in rows]
    assert "timed otherwise" not in report.markdown(_result())  # graph-only suites read as before


def test_import_vendored_honours_the_peers_dir(monkeypatch, tmp_path):
    """A vendored peer package is found in $HPCOPS_PEERS_DIR (else .peers/ at the checkout root); when it
    is nowhere, PeerUnavailable says how to vendor it."""
    import sys

    from hpcops.bench.registry import PeerUnavailable, import_vendored, peer_dirs

    (tmp_path / "hpcops_fake_peer").mkdir()
    (tmp_path / "hpcops_fake_peer" / "__init__.py").write_text("")
    (tmp_path / "hpcops_fake_peer" / "kern.py").write_text("VALUE = 42\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("HPCOPS_PEERS_DIR", raising=False)
    assert peer_dirs()[0].name == ".peers" and (peer_dirs()[0].parent / "hpcops" / "__init__.py").is_file()
    with pytest.raises(PeerUnavailable, match="not vendored.*run vendor.sh"):
        import_vendored("hpcops_fake_peer.kern", how="run vendor.sh")
    monkeypatch.setenv("HPCOPS_PEERS_DIR", str(tmp_path))
    assert import_vendored("hpcops_fake_peer.kern", how="run vendor.sh").VALUE == 42
    (tmp_path / "hpcops_fake_peer" / "broken.py").write_text("raise ImportError('half a tree')\n")
    with pytest.raises(PeerUnavailable, match="half a tree"):
        import_vendored("hpcops_fake_peer.broken", how="")
    for name in ("hpcops_fake_peer", "hpcops_fake_peer.kern"):
        sys.modules.pop(name, None)


def test_report_notes_merge_per_impl():
    """An impl's notes that differ per case (e.g. the config a peer picked) read as one line of distinct parts."""
    rows = [Row("moe", "c1", "peer", False, 1.0, "ok", note="lower bound; config a"),
            Row("moe", "c2", "peer", False, 1.0, "ok", note="lower bound; config b"),
            Row("moe", "c3", "peer", False, 1.0, "ok", note="lower bound; config a")]
    md = report.markdown(SuiteResult("moe", rows, {}))
    assert "- `peer`: lower bound; config a; config b\n" in md


@pytest.mark.gpu
def test_profiler_kernel_time_us_on_gpu():
    """The CUDA path: per-call device time of the kernels between marker kernels, all or filtered by name."""
    from hpcops.bench.timing import profiler_kernel_time_us

    xs = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
    fns = [lambda x=x: (x.mul_(1.0), x.sum()) for x in xs]  # an elementwise kernel and a reduction per call
    every = profiler_kernel_time_us(fns)
    reduce_only = profiler_kernel_time_us(fns, "reduce_kernel")
    assert 0 < reduce_only < every < 1000
    with pytest.raises(RuntimeError, match="no device events named"):
        profiler_kernel_time_us(fns, "no_such_kernel")


def test_clock_summarize_picks_the_windows_samples():
    """`clock.summarize`: only the samples inside a window count (several windows: the rounds of one row); their
    median / lowest / highest MHz, mean W and the union of the reason bits; none inside: a count of 0."""
    from hpcops.bench.clock import summarize

    samples = [(0.5, 1980.0, 100.0, 0), (1.0, 1755.0, 400.0, 0x4), (1.5, 1590.0, 500.0, 0x4),
               (2.0, 1980.0, 120.0, 0x1), (3.0, 1605.0, 480.0, 0x20)]
    got = summarize(samples, [(0.9, 1.6), (2.9, 3.1)])
    assert got == {"samples": 3, "mhz_median": 1605.0, "mhz_min": 1590.0, "mhz_max": 1755.0,
                   "watts_mean": pytest.approx(460.0), "reasons": "0x24"}
    assert summarize(samples, [(5.0, 6.0)]) == {"samples": 0}
    assert summarize(samples, []) == {"samples": 0}


class _FakeNvml:
    """The pynvml calls `ClockSampler` makes, on canned values; `fail_after` samples, the clock query raises."""
    NVML_CLOCK_SM = 1

    def __init__(self, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after

    def nvmlDeviceGetClockInfo(self, handle, which):
        assert handle == "h" and which == self.NVML_CLOCK_SM
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("NVML gone")
        return 1755

    def nvmlDeviceGetPowerUsage(self, handle):
        return 412_000  # mW

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return 0x4


def test_clock_sampler_samples_until_stopped():
    """A sampler on a fake NVML: samples (time, MHz, W, reasons) until stop(); its window summarizes them; a
    failing query ends the sampling (the run goes on without more samples)."""
    import time

    from hpcops.bench.clock import ClockSampler

    s = ClockSampler(_FakeNvml(), "h", period=0.001)
    t0 = time.monotonic()
    s._thread.start()
    deadline = time.monotonic() + 5
    while len(s.samples) < 5 and time.monotonic() < deadline:
        time.sleep(0.002)
    s.stop()
    n = len(s.samples)
    assert n >= 5 and all(x[1:] == (1755.0, 412.0, 4) for x in s.samples)
    got = s.window((t0, time.monotonic()))
    assert got["samples"] == n and got["mhz_median"] == 1755.0 and got["reasons"] == "0x4"
    time.sleep(0.01)
    assert len(s.samples) == n  # stopped: no more samples
    broken = ClockSampler(_FakeNvml(fail_after=3), "h", period=0.001)
    broken._thread.start()
    broken._thread.join(timeout=5)
    assert not broken._thread.is_alive() and len(broken.samples) == 3
    broken.stop()


def test_clock_sampler_needs_a_gpu(monkeypatch):
    """Without a CUDA device (the CPU tier) or without NVML, `ClockSampler.start` gives None: rows carry no clock."""
    from hpcops.bench.clock import ClockSampler

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ClockSampler.start() is None


def test_clock_sampler_reads_the_visible_gpu(monkeypatch):
    """`ClockSampler.start` opens the NVML handle of the CUDA device as NVML counts GPUs (CUDA_VISIBLE_DEVICES can
    hide some: torch maps the index), and samples from it."""
    import sys
    import types

    from hpcops.bench.clock import ClockSampler

    fake = _FakeNvml()
    opened = []
    mod = types.SimpleNamespace(nvmlInit=lambda: None,
                                nvmlDeviceGetHandleByIndex=lambda i: opened.append(i) or "h",
                                **{k: getattr(fake, k) for k in dir(_FakeNvml) if k.startswith(("nvml", "NVML"))})
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: i + 3)  # visible GPU 0 = NVML's GPU 3
    s = ClockSampler.start(period=0.001)
    assert s is not None and opened == [3]
    s.stop()
    assert all(x[1] == 1755.0 for x in s.samples)


def test_runner_records_timing_windows(monkeypatch):
    """`_run_impl` appends the timed replays' (start, end) of a successful timing to `windows`, nothing for one that
    failed or was not timed; `_run_rounds` keeps each impl's windows, one a round."""
    from hpcops.bench import runner, timing
    from hpcops.bench.registry import Case, Impl

    def fake(fns, replays=50, window=None):
        if window is not None:
            window.append((1.0, 2.0))  # the timed replays' span, as graph_time_us appends it
        return 10.0

    monkeypatch.setattr(timing, "graph_time_us", fake)

    def bad(x):
        raise AssertionError("no")

    case = Case("prefill", "c", make_inputs=lambda layer: layer,
                impls=[Impl("a", lambda x: (lambda: None), ours=True), Impl("b", bad)])
    win = []
    assert runner._run_impl(case, case.impls[0], [0], True, windows=win) == ("ok", 10.0)
    assert win == [(1.0, 2.0)]
    assert runner._run_impl(case, case.impls[1], [0], True, windows=win)[0].startswith("check-failed")
    assert runner._run_impl(case, case.impls[0], [0], False, windows=win) == ("check-failed", None)
    assert len(win) == 1
    windows = {}
    runner._run_rounds(case, [0], True, 3, lambda msg: None, windows)
    assert len(windows["a"]) == 3 and windows["b"] == []


def test_report_shows_the_sm_clock_where_sampled(tmp_path):
    """Rows with `sm_mhz` get an `SM MHz` column (and the table's note); a row without one leaves it empty; the
    value survives the JSON round trip; a run without clocks keeps the old table (test_report_roundtrip)."""
    res = _result()
    res.rows[0].sm_mhz = 1590.4
    res.rows[2].sm_mhz = 1980.0
    md = report.markdown(res)
    assert "| case | impl | µs | GB/s | % copy BW | TFLOP/s | x ours | SM MHz | status |" in md
    assert "| c1 | **hpcops** | 10.0 | 1000 | 50% |  |  | 1590 | ok |" in md
    assert "| c1 | peer | 25.0 | 400 | 20% |  | 2.50 | 1980 | ok |" in md
    assert "| c1 | absent | — |  |  |  |  |  | unavailable: not installed |" in md
    assert "`SM MHz`: the median SM clock" in md
    back = report.load(report.write(res, tmp_path)[0])
    assert [r.sm_mhz for r in back.rows] == [1590.4, None, 1980.0, None, None]


@pytest.mark.gpu
def test_clock_sampler_on_gpu():
    """On the GPU (with the nvidia-ml-py wheel) the sampler reads a plausible SM clock while a kernel runs."""
    pytest.importorskip("pynvml")
    import time

    from hpcops.bench.clock import ClockSampler

    s = ClockSampler.start()
    assert s is not None
    t0 = time.monotonic()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        a = a @ a.T / 64
    torch.cuda.synchronize()
    time.sleep(0.05)
    got = s.window((t0, time.monotonic()))
    from hpcops.bench.timing import graph_time_us

    win = []
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    assert graph_time_us([lambda: b @ b] * 4, replays=20, window=win) > 0
    s.stop()
    assert got["samples"] > 0 and 100 <= got["mhz_median"] <= 3500
    assert len(win) == 1 and win[0][0] < win[0][1]  # the timed replays' span


def test_eager_time_runs_before_outside_the_events(monkeypatch):
    """`eager_time_us(before=)`: the hook runs ahead of every timed launch, never between its events (an L2 flush
    must not be timed); the result is the median of the events' times."""
    from hpcops.bench import timing

    log = []

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            log.append("record")
            self.t = len(log)

        def elapsed_time(self, end):
            return (end.t - self.t) / 1e3  # ms: each launch between them counts 1 µs

    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    us = timing.eager_time_us(lambda: log.append("fn"), replays=3, warmup=1, before=lambda: log.append("flush"))
    assert log == ["fn"] + ["flush", "record", "fn", "record"] * 3
    assert us == 2.0  # record, fn, record: two log entries apart
