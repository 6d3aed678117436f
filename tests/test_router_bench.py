"""The `router` bench suite builds its cases, and its gate passes (and fails when it should) on small cases."""

from __future__ import annotations

import pytest
import torch

from hpcops.bench import get_suite
from hpcops.bench.suites import router


def test_cases_are_listed():
    everything = list(get_suite("router")({}))
    cases = [c for c in everything if not c.name.startswith("route-")]
    routes = [c for c in everything if c.name.startswith("route-")]
    assert len(routes) == len(router.ROUTE_HIDDEN) * len(router.TOKENS)
    assert [i.name for i in routes[0].impls] == ["hpcops", "torch-gemm"] and routes[0].impls[0].ours
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == len(router.ROUTINGS) * len(router.TOKENS)
    assert all(c.bytes > 0 and c.check is not None and c.impls[0].ours for c in cases)
    assert [i.name for i in cases[0].impls] == ["hpcops", "hpcops-4warps", "hpcops-batched", "torch"]
    assert len(list(get_suite("router")({"quick": True}))) == (len(router.ROUTINGS) + len(router.ROUTE_HIDDEN)) * len(
        router.QUICK_TOKENS)


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


@pytest.mark.parametrize("model", sorted(router.ROUTE_HIDDEN))
def test_route_rows_agree(model, device, monkeypatch):
    r = next(r for r in router.ROUTINGS if r.model == model)
    monkeypatch.setitem(router.ROUTE_HIDDEN, model, 256)  # interpreter-sized rows
    x = router._route_inputs(r, 5, 0, device)
    router._route_check(r)(x)
    w, ids = router._route_ours(r)(x)()
    w2, ids2 = router._route_torch_gemm(r)(x)()
    assert ids.shape == (5, r.top_k) and torch.equal(ids, ids2)
    torch.testing.assert_close(w, w2, rtol=1e-5, atol=1e-6)
