"""select_experts, the router's top-k: the kernel against its torch reference (hpcops.moe.reference), edge
cases, bad input and the torch.library op. CPU tier through the interpreter; the GPU tier runs the same tests
on the device (the `device` fixture)."""

from __future__ import annotations

import pytest
import torch

from hpcops.moe.routing import select_experts
from hpcops.testing import assert_routes_agree


def test_select_experts_bad_inputs():
    logits = torch.randn(3, 6)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, 7)
    with pytest.raises(ValueError, match="scoring"):
        select_experts(logits, 2, scoring="relu")
    with pytest.raises(ValueError, match="bias"):
        select_experts(logits, 2, scoring="sigmoid", bias=torch.zeros(5))
    with pytest.raises(TypeError, match="bias"):
        select_experts(logits, 2, scoring="sigmoid", bias=torch.zeros(6, dtype=torch.int32))
    with pytest.raises(TypeError, match="router_logits"):
        select_experts(logits.int(), 2)
    with pytest.raises(TypeError, match="scale"):
        select_experts(logits, 2, scale=torch.tensor(2.0))
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, True)


def test_select_experts_softmax():
    logits = torch.randn(11, 9)
    w, ids = select_experts(logits, 3)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and w.shape == (11, 3)
    p = torch.softmax(logits, -1)
    want_w, want_ids = p.topk(3, -1)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w / want_w.sum(-1, keepdim=True))
    w2, _ = select_experts(logits, 3, renormalize=False, scale=2.0)
    torch.testing.assert_close(w2, want_w * 2)


def test_select_experts_sigmoid_bias_hy3():
    """Hy3: sigmoid scores, bias for selection only, renormalize, × 2.826."""
    logits = torch.randn(7, 12)
    bias = torch.zeros(12)
    bias[5] = 10.0  # expert 5 always chosen though its score may be low
    w, ids = select_experts(logits, 4, scoring="sigmoid", bias=bias, scale=2.826)
    assert (ids == 5).any(-1).all()
    s = torch.sigmoid(logits)
    chosen = s.gather(1, ids.long())
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True) * 2.826)
    torch.testing.assert_close(w.sum(-1), torch.full((7,), 2.826))
    assert torch.equal(torch.sort(ids, -1).values, torch.sort((s + bias).topk(4, -1).indices.int(), -1).values)


@pytest.mark.parametrize(
    "T,E,k,scoring,bias,renorm,scale",
    [
        (4, 192, 8, "sigmoid", True, True, 2.826),  # Hy3
        (37, 192, 8, "sigmoid", True, True, 2.826),  # three token blocks, the last partial
        (5, 256, 8, "sigmoid", True, True, 2.5),  # DeepSeek-V3's E
        (9, 8, 2, "softmax", False, True, 1.0),  # Mixtral
        (6, 60, 4, "softmax", False, False, 1.0),  # E not a power of two, no renormalization
        (3, 128, 1, "sigmoid", False, False, 1.0),  # top-1, no bias
        (2, 16, 16, "softmax", False, True, 1.0),  # k = E
    ],
)
def test_select_experts_kernel_matches_reference(device, T, E, k, scoring, bias, renorm, scale):
    from hpcops.moe.reference import select_experts as reference

    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g).to(device)
    b = (0.2 * torch.randn(E, generator=g)).to(device) if bias else None
    w, ids = select_experts(logits, k, scoring=scoring, bias=b, renormalize=renorm, scale=scale)
    want_w, want_ids = reference(logits, k, scoring=scoring, bias=b, renormalize=renorm, scale=scale)
    assert w.shape == ids.shape == (T, k) and w.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w)


@pytest.mark.parametrize("E,k,scoring",
                         [(192, 8, "sigmoid"), (60, 4, "softmax"), (16, 16, "softmax"), (8, 2, "sigmoid")])
def test_select_experts_launches_match_reference(device, E, k, scoring):
    """Every launch shape (tokens a program, warps) into NaN-filled outputs: the reference's ids and weights;
    equal scores, -0.0 and a NaN order as the reference orders them."""
    from hpcops.moe import routing
    from hpcops.moe.reference import select_experts as reference

    g = torch.Generator().manual_seed(E + k)
    logits = torch.randn(19, E, generator=g).to(device)
    bias = (0.2 * torch.randn(E, generator=g)).to(device) if scoring == "sigmoid" else None
    want_w, want_ids = reference(logits, k, scoring=scoring, bias=bias, scale=2.5)
    for launch in (None, (1, 1), (4, 1), (1, 4)):
        w = torch.full((19, k), float("nan"), device=device)
        ids = torch.full((19, k), -1, dtype=torch.int32, device=device)
        routing._launch_select(logits, k, scoring, bias, True, 2.5, w, ids, launch=launch)
        assert torch.equal(ids, want_ids), launch
        torch.testing.assert_close(w, want_w)
    tied = torch.zeros(2, 8, device=device)
    tied[:, 5] = 1.0
    tied[1, 2] = float("nan")
    tied[0, 3] = -0.0
    w2 = torch.empty(2, 4, device=device)
    ids2 = torch.empty(2, 4, dtype=torch.int32, device=device)
    routing._launch_select(tied, 4, "sigmoid", None, True, 1.0, w2, ids2)
    assert ids2.cpu().tolist() == [[5, 0, 1, 2], [5, 0, 1, 3]]


def test_select_launch_rule():
    """One token a program on one warp from 128 to 512 experts (router.md: 2.6-3.3x the batched tile at T 4-512);
    several tokens a program below 128; 4 / 8 warps a token past 512."""
    from hpcops.moe.routing import batched_select_launch, select_launch

    assert [select_launch(e) for e in (128, 192, 256, 512)] == [(1, 1)] * 4
    assert select_launch(8) == (32, 1) and select_launch(60) == (16, 1)
    assert select_launch(1024) == (1, 4) and select_launch(4096) == (1, 8)
    assert batched_select_launch(192) == (4, 1) and batched_select_launch(1024) == (1, 4)


def test_select_experts_kernel_edges(device):
    """bf16 strided logits; equal scores (the lower id first); a NaN ranks last; an empty batch."""
    logits = torch.randn(6, 24, device=device).bfloat16()[:, ::2]  # stride 2 along E
    from hpcops.moe.reference import select_experts as reference

    w, ids = select_experts(logits, 3)
    want_w, want_ids = reference(logits, 3)
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w)
    tied = torch.zeros(2, 8, device=device)
    tied[:, 5] = 1.0
    tied[1, 2] = float("nan")
    _, ids = select_experts(tied, 4, scoring="sigmoid")
    assert ids.cpu().tolist() == [[5, 0, 1, 2], [5, 0, 1, 3]]
    w, ids = select_experts(torch.empty(0, 8, device=device), 2)
    assert w.shape == ids.shape == (0, 2)


def test_select_experts_opcheck(device):
    from hpcops.moe.routing import select_experts_out_op

    logits = torch.randn(5, 16, device=device)
    bias = torch.randn(16, device=device)
    w = torch.empty(5, 4, device=device)
    ids = torch.empty(5, 4, dtype=torch.int32, device=device)
    args = (logits, 4, "sigmoid", bias, True, 2.0, w, ids)
    torch.library.opcheck(select_experts_out_op, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    select_experts_out_op(*args)
    with pytest.raises(TypeError, match="topk_ids"):
        select_experts_out_op(logits, 4, "sigmoid", bias, True, 2.0, w, ids.long())
    want_w, want_ids = select_experts(logits, 4, scoring="sigmoid", bias=bias, scale=2.0)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


@pytest.mark.parametrize("T,E,H,k,scoring", [(1, 192, 300, 8, "sigmoid"), (5, 60, 257, 4, "softmax"),
                                             (19, 8, 128, 2, "softmax"), (33, 192, 520, 8, "sigmoid")])
def test_route_matches_reference(T, E, H, k, scoring, device):
    """The router GEMM's split-K partial logits, added by the top-k kernel: the reference's choice and weights
    (fp32 weight, bf16 hidden), into NaN-filled outputs."""
    from hpcops.moe import reference, routing

    g = torch.Generator().manual_seed(T * 1000 + E)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(E, H, generator=g) * H ** -0.5).to(device)
    bias = (0.1 * torch.randn(E, generator=g)).to(device) if scoring == "sigmoid" else None
    tw, ids = routing.route(hidden, w, k, scoring=scoring, bias=bias, scale=2.5)
    want_w, want_ids = reference.route(hidden, w, k, scoring=scoring, bias=bias, scale=2.5)
    assert_routes_agree(tw, ids, want_w, want_ids, hidden.float() @ w.t(), scoring=scoring, bias=bias)
    lc = routing.router_launch(T, E, H)
    assert lc.splits * lc.k_split >= H > (lc.splits - 1) * lc.k_split and lc.k_split % lc.block_k == 0


@pytest.mark.parametrize("T,E,H,cfg", [(3, 40, 300, dict(max_block_t=16, block_e=32, block_k=64, programs=24)),
                                       (20, 24, 160, dict(max_block_t=32, block_e=16, block_k=32, programs=8)),
                                       (1, 8, 64, dict(max_block_t=16, block_e=16, block_k=128, programs=1)),
                                       (37, 40, 200, dict(max_block_t=64, block_e=32, block_k=64, programs=4)),
                                       (70, 24, 96, dict(max_block_t=64, block_e=16, block_k=32, programs=1,
                                                         stages=2)),
                                       (130, 70, 192, dict(max_block_t=128, block_e=64, block_k=64, warps=8,
                                                           programs=1))])  # the prefill tiles
def test_router_partials_have_fp32_precision(T, E, H, cfg, device):
    """The fp32 weight split into three bf16 terms (three MMAs): the partial logits sum to hidden · weightᵀ within
    a few fp32 roundings of Σ|x·w| (torch's fp32 GEMM: ≤ 1.4e-7 here; without the third term 6e-7 to 1e-6),
    for several tiles and splits, ragged edges included; every partial written (no NaN from the allocation)."""
    from hpcops.moe import routing

    g = torch.Generator().manual_seed(T * 7 + E)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    w = torch.randn(E, H, generator=g).to(device)  # full 24-bit significands
    lc = routing.router_launch(T, E, H, **cfg)
    parts = routing.router_partials(hidden, w, lc)
    assert parts.shape == (lc.splits, T, E) and not parts.isnan().any()
    want = hidden.double() @ w.double().t()
    rel = ((parts.sum(0).double() - want).abs() / (hidden.double().abs() @ w.double().abs().t())).max().item()
    assert rel <= 2.5e-7, (rel, lc)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["decode", "prefill"])
def test_gpu_router_partials_precision_over_a_full_hidden(tiles):
    """One split over Hy3's whole H (4096 = 256 MMA steps of K 16 a term): the tensor core's truncating fp32
    accumulation stays within a few fp32 roundings of Σ|x·w| (one accumulator over the whole K measured 1.6e-6;
    torch's fp32 GEMM 5e-8 to 1e-7, probe_route_large_c909b5f)."""
    from hpcops.moe import routing

    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(512, 4096, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(192, 4096, generator=g) * 4096 ** -0.5).cuda()
    T = 16 if tiles == "decode" else 512
    lc = routing.router_launch(T, 192, 4096, programs=1)
    assert lc.splits == 1 and lc.block_t == (routing.ROUTER_MAX_BLOCK_T if tiles == "decode" else 128)
    parts = routing.router_partials(hidden[:T], w, lc)
    want = hidden[:T].double() @ w.double().t()
    rel = ((parts[0].double() - want).abs() / (hidden[:T].double().abs() @ w.double().abs().t())).max().item()
    assert rel <= 2.5e-7, (rel, lc)


def test_route_splits_and_partial_sums(device):
    """The split rule spreads decode sizes over ~264 programs; the top-k kernel adds [S, T, E] partials."""
    from hpcops.moe import routing
    from hpcops.moe.reference import select_experts as reference

    lc = routing.router_launch(4, 192, 4096, max_block_t=32, block_e=32, block_k=64, programs=264)
    assert (lc.block_t, lc.k_split, lc.splits) == (16, 128, 32)  # 6 E tiles × 44 wanted splits, 64-multiples
    lc = routing.router_launch(64, 192, 4096, max_block_t=32, block_e=32, block_k=128, programs=264)
    assert (lc.block_t, lc.k_split, lc.splits) == (32, 256, 16)  # 12 tiles × 22 wanted splits, 128-multiples
    assert routing.router_launch(1, 192, 4096).block_t == routing.ROUTER_MIN_BLOCK_T  # the MMA's smallest M
    assert routing.router_launch(256, 192, 4096).splits >= 1
    small, large = (routing.router_launch(t, 192, 4096) for t in (routing.ROUTER_LARGE_T - 1, routing.ROUTER_LARGE_T))
    assert small.block_t == routing.ROUTER_MAX_BLOCK_T  # prefill tiles from ROUTER_LARGE_T tokens
    assert large.block_t == routing.ROUTER_LARGE["max_block_t"] and large.warps == routing.ROUTER_LARGE["warps"]
    assert routing.router_launch(8192, 192, 4096).splits == 1  # enough tiles: no split K
    assert routing.router_launch(8192, 192, 4096, block_e=32, warps=4).warps == 4  # explicit arguments win
    parts = torch.randn(3, 7, 20, device=device)
    w = torch.full((7, 4), float("nan"), device=device)
    ids = torch.full((7, 4), -1, dtype=torch.int32, device=device)
    routing._launch_select(parts, 4, "softmax", None, True, 1.0, w, ids)
    want_w, want_ids = reference(parts.sum(0), 4, scoring="softmax")
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w)


def test_route_large_batches_and_bad_inputs(device, monkeypatch):
    from hpcops.moe import reference, routing

    monkeypatch.setattr(routing, "ROUTE_KERNEL_MAX_T", 4)  # past it: torch's GEMM, then select_experts
    hidden = torch.randn(6, 64, device=device).to(torch.bfloat16)
    w = torch.randn(16, 64, device=device)
    tw, ids = routing.route(hidden, w, 3)
    want_w, want_ids = reference.route(hidden, w, 3)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(tw, want_w)
    assert routing.route(hidden[:0], w, 3)[1].shape == (0, 3)
    many = torch.empty(routing.MAX_GRID_Z * 16 + 1, 8, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="launch"):  # more T tiles than a grid holds: an error, no launch
        routing.router_partials(many, w[:, :8], routing.router_launch(many.shape[0], 16, 8, max_block_t=16))
    bad = [("hidden", TypeError, dict(hidden=hidden.to(torch.int32))),
           ("hidden", ValueError, dict(hidden=hidden[0])),
           ("router_weight", ValueError, dict(router_weight=w[:, :32])),
           ("router_weight", TypeError, dict(router_weight=w.to(torch.int32))),
           ("top_k", ValueError, dict(top_k=17)),
           ("bias", ValueError, dict(scoring="sigmoid", bias=torch.zeros(8, device=device))),
           ("scoring", ValueError, dict(scoring="relu"))]
    for name, exc, kw in bad:
        args = {"hidden": hidden, "router_weight": w, "top_k": 3, **kw}
        with pytest.raises(exc) as info:
            routing.route(args.pop("hidden"), args.pop("router_weight"), args.pop("top_k"), **args)
        assert name in str(info.value), (name, str(info.value))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 64, 256, 511, 512, 2048, 8192])
def test_gpu_route_hy3(T):
    """Hy3's router (E 192, H 4096, fp32 weight, sigmoid + bias, × 2.826) at decode and prefill sizes, captured in
    a graph: the reference's choice (up to near ties) and weights."""
    from hpcops.moe import reference, routing
    from hpcops.testing import capture_graph

    hidden = torch.randn(T, 4096, device="cuda").to(torch.bfloat16)
    w = torch.randn(192, 4096, device="cuda") * 4096 ** -0.5
    bias = 0.1 * torch.randn(192, device="cuda")
    graph, (tw, ids) = capture_graph(lambda: routing.route(hidden, w, 8, scoring="sigmoid", bias=bias,
                                                           scale=2.826))
    tw.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want_w, want_ids = reference.route(hidden, w, 8, scoring="sigmoid", bias=bias, scale=2.826)
    assert_routes_agree(tw, ids, want_w, want_ids, hidden.float() @ w.t(), scoring="sigmoid", bias=bias)


def test_assert_routes_agree_allows_near_ties_only():
    """The comparison the route tests and the router bench's check share: a flipped near tie passes, a flip between
    experts far apart fails, and weights are compared where the ids agree."""
    logits = torch.tensor([[3.0, 2.0, 1.0 + 5e-5, 1.0], [3.0, 2.0, 1.0, 0.0]])
    want_ids = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32)
    want_w = torch.rand(2, 3)
    near = torch.tensor([[0, 1, 3], [0, 1, 2]], dtype=torch.int32)  # token 0: experts 2 and 3 are 5e-5 apart
    assert_routes_agree(torch.rand(2, 3).index_copy(0, torch.tensor([1]), want_w[1:]), near, want_w, want_ids, logits)
    swapped = torch.tensor([[1, 0, 2], [0, 1, 2]], dtype=torch.int32)  # the order within the top-k: not compared
    assert_routes_agree(torch.stack([want_w[0, [1, 0, 2]], want_w[1]]), swapped, want_w, want_ids, logits)
    with pytest.raises(AssertionError):  # but each weight stays with its expert
        assert_routes_agree(want_w, swapped, want_w, want_ids, logits)
    far = torch.tensor([[0, 1, 2], [0, 1, 3]], dtype=torch.int32)  # token 1: experts 2 and 3 are 1.0 apart
    with pytest.raises(AssertionError, match="beyond near ties"):
        assert_routes_agree(want_w, far, want_w, want_ids, logits)
    with pytest.raises(AssertionError):
        assert_routes_agree(want_w + 1.0, want_ids, want_w, want_ids, logits)
