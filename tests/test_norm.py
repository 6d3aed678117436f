"""`hpcops.norm.rms_norm` (one launch, optional residual add) against its torch reference: CPU tier through the
interpreter at small odd shapes, GPU tier at model sizes and under CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from hpcops.norm import reference as R
from hpcops.norm.rms_norm import rms_norm
from hpcops.testing import assert_close, capture_graph


def _inputs(T, H, dtype, device, stride_pad=0):
    x = torch.randn(T, H + stride_pad, device=device).to(dtype)[:, :H]  # rows further apart than H
    r = torch.randn(T, H, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(H, device=device)).to(dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,H", [(1, 7), (3, 128), (5, 1000), (2, 4096), (3, 5000)])
@pytest.mark.parametrize("with_res", [False, True])
def test_matches_reference(T, H, dtype, with_res, device):
    """Every row normalized (one chunk, and H > 4096 in two), into NaN-filled outputs; the new residual h equals
    the reference's bit for bit (one rounding of x + residual)."""
    x, r, w = _inputs(T, H, dtype, device, stride_pad=3)
    out = torch.full((T, H), float("nan"), dtype=dtype, device=device)
    if with_res:
        h_out = torch.full((T, H), float("nan"), dtype=dtype, device=device)
        got, h = rms_norm(x, w, 1e-5, residual=r, out=out, residual_out=h_out)
        want, want_h = R.rms_norm(x, w, 1e-5, residual=r)
        assert got is out and h is h_out and torch.equal(h, want_h)
    else:
        got = rms_norm(x, w, 1e-5, out=out)
        want = R.rms_norm(x, w, 1e-5)
        assert got is out
    assert_close(want, got)
    assert want.abs().max() > 0.5  # normalized rows: values of order 1, not zeros


def test_fp32_weight_and_new_outputs(device):
    x, r, _ = _inputs(4, 300, torch.bfloat16, device)
    w = 1 + 0.1 * torch.randn(300, device=device)  # fp32 weight over bf16 rows (as the layer bench keeps them)
    got, h = rms_norm(x, w, residual=r)
    want, want_h = R.rms_norm(x, w, residual=r)
    assert got.dtype == h.dtype == torch.bfloat16 and torch.equal(h, want_h)
    assert_close(want, got)
    assert rms_norm(x[:0], w).shape == (0, 300)


def test_bad_inputs(device):
    x, r, w = _inputs(3, 64, torch.bfloat16, device)
    cases = [
        ("x", TypeError, dict(x=x.to(torch.int32), weight=w)),
        ("x", ValueError, dict(x=x[0], weight=w)),
        ("weight", ValueError, dict(x=x, weight=w[:32])),
        ("weight", TypeError, dict(x=x, weight=w.to(torch.int32))),
        ("eps", ValueError, dict(x=x, weight=w, eps=-1.0)),
        ("eps", ValueError, dict(x=x, weight=w, eps="1e-6")),
        ("residual", TypeError, dict(x=x, weight=w, residual=r.half())),
        ("residual", ValueError, dict(x=x, weight=w, residual=r[:2])),
        ("out", TypeError, dict(x=x, weight=w, out=torch.empty(3, 64, device=device))),
        ("residual_out", ValueError, dict(x=x, weight=w, residual_out=torch.empty_like(x))),
        ("x", ValueError, dict(x=torch.randn(64, 3, device=device).to(torch.bfloat16).t(), weight=w)),  # H strided
    ]
    for name, exc, kw in cases:
        with pytest.raises(exc) as info:
            rms_norm(**kw)
        assert name in str(info.value), (name, str(info.value))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
@pytest.mark.parametrize("H", [4096, 7168])
def test_gpu_model_sizes_and_graph(T, H):
    x, r, w = _inputs(T, H, torch.bfloat16, "cuda")
    want, want_h = R.rms_norm(x, w, 1e-5, residual=r)
    out, h = torch.empty_like(r), torch.empty_like(r)
    graph, _ = capture_graph(lambda: rms_norm(x, w, 1e-5, residual=r, out=out, residual_out=h))
    out.fill_(float("nan"))
    h.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(h, want_h)
    assert_close(want, out)
    assert_close(R.rms_norm(x, w), rms_norm(x, w))
