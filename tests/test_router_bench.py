"""The `router` bench suite builds its cases, and its gate passes (and fails when it should) on small cases."""

from __future__ import annotations

import pytest
import torch

from hpcops.bench import get_suite
from hpcops.bench.suites import router


def test_cases_are_listed():
    cases = list(get_suite("router")({}))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == len(router.ROUTINGS) * len(router.TOKENS)
    assert all(c.bytes > 0 and c.check is not None and c.impls[0].ours for c in cases)
    assert [i.name for i in cases[0].impls] == ["hpcops", "hpcops-4warps", "hpcops-batched", "torch"]
    assert len(list(get_suite("router")({"quick": True}))) == len(router.ROUTINGS) * len(router.QUICK_TOKENS)


@pytest.mark.parametrize("r", router.ROUTINGS, ids=lambda r: r.model)
def test_gate_and_rows_agree(r, device):
    x = router._make_inputs(r, 5, 0, device)
    router._check(r)(x)
    w, ids = router._ours(r)(x)()
    w2, ids2 = router._torch(r)(x)()
    w3, ids3 = router._ours(r, router._four_warps(r.experts))(x)()
    w4, ids4 = router._ours(r, (1, 1))(x)()
    assert torch.equal(ids4, ids2) and torch.allclose(w4, w2)
    assert torch.equal(ids, ids2) and torch.allclose(w, w2)
    assert torch.equal(ids3, ids2) and torch.allclose(w3, w2)
    assert ids.shape == (5, r.top_k) and int(ids.max()) < r.experts


def test_gate_fails_on_a_wrong_answer(device, monkeypatch):
    r = router.ROUTINGS[0]
    x = router._make_inputs(r, 3, 0, device)
    from hpcops.moe import routing

    real = routing.select_experts
    monkeypatch.setattr(routing, "select_experts", lambda *a, **k: (real(*a, **k)[0], real(*a, **k)[1].flip(-1)))
    with pytest.raises(AssertionError, match="expert ids"):
        router._check(r)(x)
