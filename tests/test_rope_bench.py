"""The `rope` bench suite builds its cases, and its correctness gate passes on a small case (CPU tier)."""

from __future__ import annotations

import pytest
import torch

from hpcops.bench import PeerUnavailable, get_suite
from hpcops.bench.suites import rope
from hpcops.testing import assert_close


def test_cases_are_listed():
    cases = list(get_suite("rope")({}))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 2 * 2 * len(rope.TOKENS) + 2 * 2 * len(rope.STORE_TOKENS)
    assert all(c.bytes > 0 and c.check is not None and c.impls[0].ours for c in cases)
    assert len(list(get_suite("rope")({"quick": True}))) == 2 * len(rope.QUICK_TOKENS) + 2 * 2


@pytest.mark.parametrize("t,fp8", [(1, True), (3, False), (5, True)])
def test_store_kv_gate_and_torch_peer(t, fp8, device):
    """The store-kv cases: the gate (store_kv against its reference, bit for bit) passes, and the torch peer (the
    vLLM backend's old scatter) writes the same cache."""
    import torch

    s = rope.Scenario(t, 8, 1, fp8)
    x = rope._make_inputs(s, 0, device=device)
    rope._store_check(s)(x)
    kc, vc = x["k_cache"], x["v_cache"]
    rope._store_ours(s)(x)()
    ours = kc.clone(), vc.clone()
    kc.zero_(), vc.zero_()
    rope._store_torch(s)(x)()
    for a, b in zip(ours, (kc, vc)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("t,fp8", [(1, True), (3, False)])
def test_gate_and_torch_peer(t, fp8, device):
    s = rope.Scenario(t, 8, 1, fp8)
    x = rope._make_inputs(s, 0, device=device)
    rope._check(s)(x)  # ours vs the reference on this case's inputs
    q, q_scale = rope._torch(s)(x)()  # the capturable unfused peer agrees with the reference
    q2, q_scale2 = rope._ours(s)(x)()
    assert_close(q, q2, name="q")
    assert (q_scale is None) == (not fp8)


def test_prefill_inputs_are_consistent():
    s = rope.Scenario(2 * rope.PREFILL_CHUNK + 5, 8, 1, False)
    x = rope._make_inputs(s, 1, device="cpu")
    slots = x["slot_mapping"]
    assert len(set(slots.tolist())) == s.t  # distinct slots
    assert torch.equal(slots % rope.PAGE, x["positions"] % rope.PAGE)
    assert int(slots.max()) < x["k_cache"].shape[0] * rope.PAGE


def test_flashinfer_peer_unavailable_without_flashinfer():
    try:
        import flashinfer  # noqa: F401
    except Exception:
        s = rope.Scenario(1, 8, 1, False)
        with pytest.raises(PeerUnavailable):
            rope._flashinfer(s)(rope._make_inputs(s, 0, device="cpu"))
    else:
        pytest.skip("flashinfer is installed here")


def test_sweep_configs_from_env(monkeypatch):
    monkeypatch.setenv("HPCOPS_ROPE_CONFIGS", "4x8, 8x4x2")
    case = next(iter(get_suite("rope")({"quick": True})))
    names = [i.name for i in case.impls]
    assert "hpcops-bt4w8" in names and "hpcops-bt8w4kv2" in names

