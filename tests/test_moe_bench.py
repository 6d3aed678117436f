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


@pytest.mark.parametrize("layout,kind", [("tp8", "fp8_tensor"), ("ep8", "fp8_block"), ("ep8", "none")])
def test_case_runs_on_cpu(tiny, layout, kind):
    s = suite.Scenario(layout, 5, kind)
    nbytes, flops = suite._traffic(s)
    assert nbytes > 0 and flops > 0
    x = suite._make_inputs(s, 0, device="cpu")
    suite._check(s)(x)  # the correctness gate
    out = suite._ours(s)(x)()
    assert torch.isfinite(out).all()
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
