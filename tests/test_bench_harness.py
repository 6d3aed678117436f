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
