"""The `moe` bench suite, shrunk to CPU size: cases enumerate, inputs build, the gate passes, impls run."""

from __future__ import annotations

import pytest
import torch

from hpcops.bench.registry import Case, PeerUnavailable
from hpcops.bench.suites import moe as suite


def test_cases_enumerate():
    full = list(suite.cases({}))
    quick = list(suite.cases({"quick": True}))
    assert len(quick) < len(full)
    names = [c.name for c in full]
    assert len(set(names)) == len(names)
    assert all(isinstance(c, Case) and c.bytes > 0 and c.flops > 0 for c in full)
    assert not any("tp8-fp8b" in n for n in names), "block quant needs I % 128 == 0; Hy3 TP8 has I = 192"
    c = next(c for c in full if c.name == "B4-tp8-fp8t")
    assert c.params["target_us"] == 30 and c.params["vllm_triton_us"] == 57
    assert [i.name for i in c.impls][:1] == ["hpcops"] and c.impls[0].ours


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(suite, "E_GLOBAL", 8)
    monkeypatch.setattr(suite, "TOP_K", 3)
    monkeypatch.setattr(suite, "HIDDEN", 256)
    monkeypatch.setattr(suite, "INTER", {"tp8": 128, "ep8": 128})
    monkeypatch.setattr(suite, "N_LOCAL", {"tp8": 8, "ep8": 3})


@pytest.mark.parametrize("layout,kind,t", [("tp8", "fp8_tensor", 5), ("tp8", "fp8_tensor", 1), ("ep8", "fp8_block", 5),
                                            ("ep8", "none", 5)])
def test_case_runs(tiny, layout, kind, t, device):
    """On the tier's device: the compiled kernels on the GPU (CPU tensors would reach a compiled Triton
    launch there: ValueError 'cannot be accessed from Triton'), the interpreter on the CPU. T 1 takes
    the small-batch path (fused reduce), T 5 the sorted one."""
    s = suite.Scenario(layout, t, kind)
    nbytes, flops = suite._traffic(s)
    assert nbytes > 0 and flops > 0
    x = suite._make_inputs(s, 0, device=device)
    assert x["x"].device.type == x["w13"].device.type == x["ids"].device.type == torch.device(device).type
    suite._check(s)(x)  # the correctness gate
    out = suite._ours(s)(x)()
    assert out.device.type == torch.device(device).type and torch.isfinite(out).all()
    for peer in (suite._grouped_mm(s), suite._torch_loop(s)):
        try:
            fn = peer(x)
        except PeerUnavailable:
            continue
        fn()


def test_config_sweep_env(monkeypatch):
    monkeypatch.setenv("HPCOPS_MOE_CONFIGS", "block_m=32,block_n=64;num_stages=2")
    assert suite._config_overrides() == [{"block_m": 32, "block_n": 64}, {"num_stages": 2}]
    monkeypatch.setenv("HPCOPS_MOE_CONFIGS", "blk=3")
    with pytest.raises(ValueError, match="blk"):
        suite._config_overrides()


def test_sweep_script_dry_run():
    """scripts/sweep_moe.py --dry-run lists its variants without a GPU; every variant is a valid MoeConfig."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    from hpcops.moe.configs import MoeConfig

    path = Path(__file__).resolve().parents[1] / "scripts" / "sweep_moe.py"
    res = subprocess.run([sys.executable, str(path), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "B4-tp8-fp8t" in res.stdout and "B512-ep8-fp8t" in res.stdout
    spec = importlib.util.spec_from_file_location("sweep_moe", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for layout, t in sweep.SCENARIOS:
        s = sweep._scenario(layout, t)
        base = sweep.base_config(s)
        for v in sweep.stage_a1(s, base) + [w for f in (sweep.stage_a2, sweep.stage_b1, sweep.stage_b2)
                                            for w in f(s, base)]:
            MoeConfig(**v)
