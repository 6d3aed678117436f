"""The `norm` bench suite lists its cases, and its rows agree with the gate on a small case."""

from __future__ import annotations

import pytest
import torch

from hpcops.bench import get_suite
from hpcops.bench.suites import norm


def test_cases_are_listed():
    cases = list(get_suite("norm")({}))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == len(norm.HIDDEN) * 2 * len(norm.TOKENS)
    assert all(c.bytes > 0 and c.check is not None and c.impls[0].ours for c in cases)
    assert [i.name for i in cases[0].impls] == ["hpcops", "torch-fp32", "torch"]
    assert len(list(get_suite("norm")({"quick": True}))) == len(norm.HIDDEN) * 2 * len(norm.QUICK_TOKENS)


@pytest.mark.parametrize("res", [False, True])
def test_gate_and_rows_agree(res, device):
    x = norm._make_inputs(3, 300, 0, device)
    norm._check(res)(x)
    ours, ref = norm._ours(res)(x)(), norm._torch_fp32(res)(x)()
    if res:
        assert torch.equal(ours[1], ref[1])
        ours, ref = ours[0], ref[0]
    assert (ours.float() - ref.float()).abs().max() <= 0.02 * ref.float().abs().max()


def test_gate_fails_on_a_wrong_answer(device, monkeypatch):
    from hpcops.norm import rms_norm as mod

    x = norm._make_inputs(3, 300, 0, device)
    real = mod.rms_norm
    monkeypatch.setattr(mod, "rms_norm", lambda *a, **k: real(*a, **k).mul_(1.1))
    with pytest.raises(AssertionError, match="rms_norm"):
        norm._check(False)(x)
