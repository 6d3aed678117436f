"""The `layer` bench suite (issue 11) shrunk to CPU size: scenarios, the fp32 reference against the hpcops
composition through the interpreter, the allowance arithmetic, the derived rows and reports, missing peers."""

from __future__ import annotations

import json

import pytest
import torch

from hpcops.bench.registry import SUITES, Case, PeerUnavailable, suite_finisher
from hpcops.bench.runner import Row, SuiteResult
from hpcops.bench.suites import _layer_report as rep
from hpcops.bench.suites import layer as suite


@pytest.fixture
def tiny_layer(tiny_layer_suite):
    """Hy3's layer at interpreter sizes (conftest: H 256, E 8 (EP: 3 local), top-3, I 128, shared I 64)."""
    return tiny_layer_suite


def test_scenarios_cover_the_issue():
    full = suite.scenarios()
    names = [s.name for s in full]
    assert len(set(names)) == len(names)
    prefill = [s for s in full if s.prefill]
    full = [s for s in full if not s.prefill]
    assert {s.b for s in full} == {1, 4, 16, 64, 256, 32}
    assert {s.layout for s in full} == {"tp8", "ep8"} and {s.kv for s in full} == {"fp8", "bf16"}
    for b in suite.BATCHES:
        assert {s.ctx for s in full if s.b == b} >= {"u4K", "logmix"}
    # the blog's table-3 mixes of 32 and 64 requests (64x4K is the uniform row)
    assert {s.ctx for s in full} - {"u4K", "logmix"} == {"2x32K+30x4K", "1x128K+31x4K", "64x0.5K",
                                                         "32x0.125K+32x4K"}
    assert len(full) == (5 * 2 + 4) * 2 * 2
    # prefill: one prompt of 2K, 8K, 32K tokens, fp8 and bf16 KV, both ranks
    assert sorted(s.name for s in prefill) == sorted(f"prefill-{k}K-{kv}-{lay}" for k in (2, 8, 32)
                                                     for kv in ("fp8", "bf16") for lay in ("tp8", "ep8"))
    s = next(s for s in prefill if s.name == "prefill-32K-fp8-ep8")
    assert (s.b, s.t, s.lens, s.e_local, s.inter, s.kind) == (1, 32768, [32768], 24, 1536, "fp8_tensor")
    # quick: decode B 4 and 64 at u4K, both KV dtypes and ranks; prefill 2K and 8K, both KV dtypes, TP8
    quick = suite.scenarios(quick=True)
    assert [s.name for s in quick if not s.prefill] == [f"B{b}-u4K-{kv}-{lay}" for kv in ("fp8", "bf16")
                                                        for lay in ("tp8", "ep8") for b in (4, 64)]
    assert [s.name for s in quick if s.prefill] == [f"prefill-{k}K-{kv}-tp8" for kv in ("fp8", "bf16")
                                                    for k in (2, 8)]
    assert len(quick) == 12
    s = next(s for s in full if s.name == "B64-32x0.125K+32x4K-bf16-ep8")
    assert (s.e_local, s.inter, s.kind, s.ep) == (24, 1536, "none", True)
    s = next(s for s in full if s.name == "B1-u4K-fp8-tp8")
    assert (s.e_local, s.inter, s.kind, s.ep, s.lens) == (192, 192, "fp8_tensor", False, [4096])
    assert "layer" in SUITES and suite.MODEL_LAYERS == 80


def test_logmix_is_seeded_and_in_range():
    a, b = suite.context_lens("logmix", 256), suite.context_lens("logmix", 256)
    assert a == b and len(a) == 256
    assert min(a) >= 100 and max(a) <= 100_000
    assert min(a) < 1000 and max(a) > 10_000  # spread over the decades
    with pytest.raises(ValueError, match="not B = 4"):
        suite.context_lens("64x4K", 4)


def test_case_rows_and_timing():
    c = suite.case_for(suite.Scenario(4, "u4K", "fp8", "tp8"))
    assert isinstance(c, Case) and c.bytes > 4 * 4096 * 256 and c.check is not None
    impls = {i.name: i for i in c.impls}
    assert c.impls[0].name == "hpcops" and c.impls[0].ours and c.impls[0].timing == "graph"
    assert impls["hpcops-plan"].per_step
    assert impls["baseline-rest"].timing == "graph" and not impls["baseline-rest"].ours
    assert impls["baseline-moe-kernels"].timing == "kernels"
    assert impls["baseline-moe-kernels"].kernel_filter == "fused_moe_kernel"
    assert set(suite.COMPONENTS) <= set(impls)
    assert c.command == "hpcops bench layer --only B4-u4K-fp8-tp8"
    assert c.layers is None and c.params["phase"] == "decode" and c.params["T"] == 4
    # prefill: no plan row, two layers per graph (a layer's MoE weights alone exceed L2), T = the prompt
    p = suite.case_for(suite.Scenario(1, "", "bf16", "ep8", 32768))
    assert "hpcops-plan" not in {i.name for i in p.impls} and set(suite.COMPONENTS) <= {i.name for i in p.impls}
    assert p.layers == 2 and p.bytes > 24 * 3 * 1536 * 4096 * 2
    assert (p.params["phase"], p.params["T"], p.params["B"]) == ("prefill", 32768, 1)
    assert p.command == "hpcops bench layer --only prefill-32K-bf16-ep8"
    assert next(suite.cases({"quick": True, "layers": 3})).layers is None  # --layers wins
    quick = list(suite.cases({"quick": True}))
    assert [c.layers for c in quick if c.params["phase"] == "prefill"] == [2] * 4
    assert all(c.layers is None for c in quick if c.params["phase"] == "decode")


def test_check_rows():
    assert suite.check_rows(suite.Scenario(3, "70,130,65", "bf16", "tp8")) == [0, 1, 2]
    assert suite.check_rows(suite.Scenario(64, "u4K", "bf16", "tp8")) == [0, 1, 2, 3]
    assert suite.check_rows(suite.Scenario(1, "", "fp8", "tp8", 2048)) == [0, 682, 1365, 2047]


def test_allowance_arithmetic():
    # TP8 B=1 bf16: vLLM skips align (1·8·4 <= 192): act, sum; moe_sum 1·8·4096·2 B at 4096 GB/s
    assert rep.vllm_helpers(1, 8, 192, False, False) == ["act", "sum"]
    assert rep.allowance_us(1, 8, 4096, 192, False, False, 4096.0) == pytest.approx(6.0 + 65536 / 4096e3)
    # EP8 fp8 B=64: align, act+quant, x-quant, sum; 64·8·4096·2 = 4 MiB at 4000 GB/s = 1.048576 µs
    assert rep.vllm_helpers(64, 8, 192, True, True) == ["align", "act+quant", "x-quant", "sum"]
    assert rep.allowance_us(64, 8, 4096, 192, True, True, 4000.0) == pytest.approx(12.0 + 4194304 / 4000e3)
    # TP8 B=256 fp8: align runs (256·8·4 > 192); without a measured bandwidth the default is used
    assert rep.allowance_us(256, 8, 4096, 192, False, True) == pytest.approx(
        12.0 + 256 * 8 * 4096 * 2 / (rep.DEFAULT_COPY_GBPS * 1e3))


def _row(impl, us, case="B4-u4K-fp8-tp8", b=4, status="ok", timing="graph", prompt=0):
    params = {"B": b, "top_k": 8, "H": 4096, "E_global": 192, "layout": "tp8", "kv": "fp8", "model_layers": 80,
              "shared_stream": b <= 256}
    if prompt:
        params.update(phase="prefill", B=1, T=prompt, prompt=prompt, shared_stream=False)
    return Row(suite="layer", case=case, impl=impl, ours=impl.startswith("hpcops"), us=us, status=status,
               params=params, timing=timing, note="per-step" if impl == "hpcops-plan" else "")


def test_derived_baseline_summary_and_reports(tmp_path):
    comp = {"shared:1-norm-qkv": 10.0, "hpcops:2-rope-kv": 2.0, "baseline:2-rope-kv": 8.0,
            "hpcops:3-attention": 20.0, "baseline:3-attention": 25.0, "shared:4-oproj-residual": 9.0,
            "hpcops:5a-norm-route": 7.0,
            "baseline:5a-norm-router-select": 9.0, "shared:5s-shared-expert": 6.0, "hpcops:5b-moe": 30.0,
            "baseline:5c-combine": 3.0}
    rows = [_row("hpcops", 80.0), _row("hpcops-plan", 4.0), _row("baseline-rest", 70.0),
            _row("baseline-moe-kernels", 28.0, timing="kernels"), *[_row(k, v) for k, v in comp.items()]]
    result = SuiteResult("layer", rows, {"copy_gbps": 4000.0})
    done, paths = suite_finisher("layer")(result, tmp_path)
    base = next(r for r in done.rows if r.impl == "baseline")
    # B=4 TP8 fp8: 4·8·4 = 128 <= 192, vLLM skips align: 3 helpers
    assert rep.vllm_helpers(4, 8, 192, False, True) == ["act+quant", "x-quant", "sum"]
    allow = 9.0 + 4 * 8 * 4096 * 2 / 4000e3
    # B ≤ 256: vLLM's shared expert on its aux stream, hidden under the routed MoE (here the longer of the two)
    assert base.us == pytest.approx(70.0 + 28.0 + allow) and base.status == "ok" and "allowance" in base.note
    assert "auxiliary stream" in base.note
    rest, moe = _row("baseline-rest", 70.0), _row("baseline-moe-kernels", 28.0, timing="kernels")
    assert rep.derived_baseline([rest, moe, _row("shared:5s-shared-expert", 50.0)], 4000.0).us == pytest.approx(120.0)
    missing = rep.derived_baseline([rest, moe], 4000.0)
    assert missing.us is None and missing.status == "unavailable: baseline rows missing"
    assert [r.impl for r in done.rows][:2] == ["hpcops", "baseline"]
    summary = json.loads((tmp_path / "layer.summary.json").read_text())
    c = summary["cases"]["B4-u4K-fp8-tp8"]
    assert c["step_hpcops_ms"] == pytest.approx((80 * 80.0 + 4.0) / 1e3)
    assert c["step_baseline_ms"] == pytest.approx(80 * base.us / 1e3)
    assert c["tpot_reduction_pct"] == pytest.approx(100 * (1 - (6404.0 / (80 * base.us))))
    assert c["components"]["5b routed MoE + residual"]["baseline"] == pytest.approx(28.0 + allow + 3.0)
    assert c["components"]["2 QK-norm + RoPE + KV write"] == {"hpcops": 2.0, "baseline": 8.0}
    assert summary["geomean_tpot_reduction_pct_b_le_64"] == pytest.approx(c["tpot_reduction_pct"])
    md = (tmp_path / "layer.components.md").read_text()
    assert "B4-u4K-fp8-tp8" in md and "allowance" in md and "80 layers" in md
    assert {p.name for p in paths} >= {"layer.components.md", "layer.summary.json"}
    again, _ = suite_finisher("layer")(done, tmp_path)  # idempotent (the CLI finishes after every case)
    assert [r.impl for r in again.rows] == [r.impl for r in done.rows]
    assert c["components"]["5s shared expert"] == {"hpcops": 6.0, "baseline": 6.0}
    for r in rows:  # hpcops computing the shared expert in its MoE kernels: its 5s is inside its 5b
        r.params["shared_fused"] = True
    fused = rep.summarize(SuiteResult("layer", rows, {"copy_gbps": 4000.0}))["cases"]["B4-u4K-fp8-tp8"]
    assert fused["components"]["5s shared expert"] == {"hpcops": 0.0, "baseline": 6.0}


def test_prefill_rows_report_ttft(tmp_path):
    case = "prefill-2K-fp8-tp8"
    comp = {"shared:1-norm-qkv": 100.0, "hpcops:2-rope-kv": 20.0, "baseline:2-rope-kv": 60.0,
            "hpcops:3-attention": 300.0, "baseline:3-attention": 500.0, "shared:4-oproj-residual": 80.0,
            "hpcops:5a-norm-route": 100.0,
            "baseline:5a-norm-router-select": 100.0, "shared:5s-shared-expert": 50.0, "hpcops:5b-moe": 700.0,
            "baseline:5c-combine": 30.0}
    rows = [_row("hpcops", 1400.0, case=case, prompt=2048), _row("baseline-rest", 1000.0, case=case, prompt=2048),
            _row("baseline-moe-kernels", 650.0, case=case, timing="kernels", prompt=2048),
            *[_row(k, v, case=case, prompt=2048) for k, v in comp.items()],
            _row("hpcops", 80.0), _row("baseline-rest", 70.0), _row("baseline-moe-kernels", 28.0, timing="kernels"),
            _row("shared:5s-shared-expert", 6.0)]
    done, paths = rep.finish(SuiteResult("layer", rows, {"copy_gbps": 4000.0}), tmp_path)
    # the allowance counts the prompt's tokens: align runs (2048·8·4 > 192), act+quant, x-quant, sum, and
    # moe_sum's 2048·8·4096·2 bytes at 4000 GB/s
    allow = 12.0 + 2048 * 8 * 4096 * 2 / 4000e3
    base = next(r for r in done.rows if r.impl == "baseline" and r.case == case)
    assert base.us == pytest.approx(1000.0 + 650.0 + allow)
    summary = json.loads((tmp_path / "layer.summary.json").read_text())
    c = summary["cases"][case]
    assert c["phase"] == "prefill" and "tpot_reduction_pct" not in c and c["plan_us"] is None
    assert c["ttft_hpcops_ms"] == pytest.approx(80 * 1400.0 / 1e3)
    assert c["ttft_baseline_ms"] == pytest.approx(80 * base.us / 1e3)
    assert c["ttft_reduction_pct"] == pytest.approx(100 * (1 - 1400.0 / base.us))
    assert c["components"]["5b routed MoE + residual"] == {"hpcops": 700.0, "baseline": pytest.approx(
        650.0 + allow + 30.0)}
    assert c["components"]["3 attention"] == {"hpcops": 300.0, "baseline": 500.0}
    assert summary["geomean_ttft_reduction_pct"] == pytest.approx(c["ttft_reduction_pct"])
    assert summary["min_ttft_reduction_pct"] == pytest.approx(c["ttft_reduction_pct"])
    assert summary["targets"]["ttft_pct"] == 10.0
    # the decode case keeps its TPOT, and only it enters the decode geomean
    d = summary["cases"]["B4-u4K-fp8-tp8"]
    assert d["phase"] == "decode" and summary["geomean_tpot_reduction_pct_b_le_64"] == pytest.approx(
        d["tpot_reduction_pct"])
    md = (tmp_path / "layer.components.md").read_text()
    assert "## decode" in md and "## prefill" in md and "TTFT" in md
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {case} |"))
    assert f"| {112.0:.2f} / {80 * base.us / 1e3:.2f} | {c['ttft_reduction_pct']:.1f} |" in line
    assert "300.0 / 500.0" in line
    assert (tmp_path / "layer.stack.png").is_file() and any(p.name == "layer.stack.png" for p in paths)


def test_missing_peer_makes_baseline_unavailable(tmp_path):
    reason = "unavailable: flashinfer not importable: ModuleNotFoundError"
    rows = [_row("hpcops", 80.0), _row("baseline-rest", None, status=reason),
            _row("baseline-moe-kernels", 28.0, timing="kernels"), _row("shared:5s-shared-expert", 6.0)]
    done, _ = rep.finish(SuiteResult("layer", rows, {}), tmp_path)
    base = next(r for r in done.rows if r.impl == "baseline")
    assert base.us is None and base.status == reason
    assert "tpot_reduction_pct" not in rep.summarize(done)["cases"]["B4-u4K-fp8-tp8"]


def test_peers_unavailable_raise_peer_unavailable(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_flashinfer(name, *a, **kw):
        if name == "flashinfer":
            raise ModuleNotFoundError("No module named 'flashinfer'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    with pytest.raises(PeerUnavailable, match="flashinfer not importable"):
        suite._flashinfer()
    monkeypatch.setenv("HPCOPS_PEERS_DIR", "/nonexistent-peers")
    # an earlier test (tune, decode grid) may have imported the vendored tree: forget it for this test
    sys = __import__("sys")
    for name in [m for m in sys.modules if m == "vllm_kernels" or m.startswith("vllm_kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not p.rstrip("/").endswith(".peers")])
    with pytest.raises(PeerUnavailable, match="vllm_kernels is not vendored"):
        suite._bl_experts(suite.Scenario(4, "u4K", "bf16", "tp8"), {"quant": None, "emap": None})


@pytest.mark.parametrize("kv,layout", [("bf16", "tp8"), ("fp8", "ep8")])
def test_hpcops_layer_matches_fp32_reference(tiny_layer, device, kv, layout):
    s = suite.Scenario(3, "70,130,65", kv, layout)
    x = suite.make_inputs(s, 0, device=device)
    suite.check(s)(x)  # the case's gate: hpcops composition vs the fp32 reference, first CHECK_B rows
    # and by hand, with values: the update is neither zero nor the reference's shifted
    trace = {}
    got = suite.hpcops_layer(s, x, suite.plan_for(x), x["hidden"], trace)
    want, own = suite.reference_layer(s, x, [0, 1, 2], trace["ids"])
    upd_got, upd_want = got.float() - x["hidden"].float(), want - x["hidden"].float()
    assert upd_want.abs().max() > 0.1
    rel = (upd_got - upd_want).norm() / upd_want.norm()
    assert rel < 0.05, rel
    assert own.shape == (3, 3) and trace["ids"].dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_gpu_layer_graph_with_the_shared_expert_beside(tiny_layer, kv):
    """At decode sizes step 5's shared expert runs beside the routed MoE (fused into its kernels, or on the
    auxiliary stream): each mode gives the one-stream result (the fused one up to the shared output's rounding),
    and a captured layer replays to the eager layer."""
    from hpcops.testing import assert_close, capture_graph

    s = suite.Scenario(3, "70,130,65", kv, "tp8")
    x = suite.make_inputs(s, 0, device="cuda")
    assert suite.shared_on_aux_stream(s.t, x["hidden"].device)
    plan = suite.plan_for(x)
    eager = suite.hpcops_layer(s, x, plan, x["hidden"]).clone()
    h1 = x["hidden"] + torch.randn_like(x["hidden"])
    got = {}
    for mode in suite.SHARED_MODES:
        trace = {}
        got[mode] = suite.hp_step5(s, x, h1, trace, shared_mode=mode).clone()
        got[mode + "-ids"] = trace["ids"]
    assert torch.equal(got["inline-ids"], got["aux-ids"]) and torch.equal(got["inline"], got["aux"])
    assert torch.equal(got["inline-ids"], got["fused-ids"])
    assert_close(got["inline"].float(), got["fused"].float(), maxtol=2e-2, rmstol=5e-3)
    graph, out = capture_graph(lambda: suite.hpcops_layer(s, x, plan, x["hidden"]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(eager, out, maxtol=1e-2, rmstol=1e-3)


def test_gate_fails_on_a_wrong_layer(tiny_layer, device):
    s = suite.Scenario(3, "70,130,65", "bf16", "tp8")
    x = suite.make_inputs(s, 0, device=device)
    trace = {}
    got = suite.hpcops_layer(s, x, suite.plan_for(x), x["hidden"], trace)
    bad = got.clone()
    bad[1] += (got[1] - x["hidden"][1]) * 0.5  # a 50 % error in one row's update
    with pytest.raises(AssertionError):
        suite.assert_layer_matches(s, x, bad, trace["ids"], "broken")


@pytest.mark.parametrize("kv,layout", [("bf16", "tp8"), ("fp8", "ep8")])
def test_hpcops_prefill_layer_matches_fp32_reference(tiny_layer, device, kv, layout):
    s = suite.Scenario(1, "", kv, layout, 70)  # one prompt of 70 tokens: two pages, the second partial
    x = suite.make_inputs(s, 0, device=device)
    assert x["hidden"].shape == (70, suite.HIDDEN) and x["positions"].tolist() == list(range(70))
    table = x["block_table"][0].long()
    assert x["slot_mapping"].tolist() == [int(table[p // 64]) * 64 + p % 64 for p in range(70)]
    assert x["fi_indptr"].tolist() == [0, 2] and x["fi_last"].tolist() == [6] and x["fi_batch"].sum() == 0
    assert suite.plan_for(x) is None
    trace = {}
    got = suite.hpcops_layer(s, x, None, x["hidden"], trace)
    rows = suite.check_rows(s)
    assert rows == [0, 23, 46, 69]
    suite.assert_layer_matches(s, x, got, trace["ids"], "hpcops")  # the case's gate on these rows
    want, _ = suite.reference_layer(s, x, rows, trace["ids"][rows])
    base = x["hidden"][rows].float()
    upd_got, upd_want = got[rows].float() - base, want - base
    assert upd_want.abs().max() > 0.1
    rel = (upd_got - upd_want).norm() / upd_want.norm()
    assert rel < 0.05, rel
    bad = got.clone()
    bad[69] += (got[69] - x["hidden"][69]) * 0.5  # a 50 % error in the last token's update
    with pytest.raises(AssertionError):
        suite.assert_layer_matches(s, x, bad, trace["ids"], "broken")
    # the prompt's K is in the cache: token 69's key (the reference's, fp8-rounded) at its slot
    k69 = x["k_cache"].reshape(-1, suite.HKV, suite.HEAD_DIM)[int(x["slot_mapping"][69])]
    assert torch.isfinite(k69.float()).all() and k69.float().abs().max() > 0


class _FakeFlashInfer:
    """FlashInfer's three calls the baseline makes, in torch (the CPU has no FlashInfer): enough to run the
    baseline's composition and its gate through the interpreter, with vLLM's vendored Triton MoE."""

    class rope:  # noqa: N801 - mirrors flashinfer.rope
        @staticmethod
        def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
            from hpcops.rope.reference import _rope

            cs = cos_sin_cache[positions.long()].float()
            cos, sin = cs[:, None, : head_size // 2], cs[:, None, head_size // 2:]
            for t in (query, key):
                v = t.view(t.shape[0], -1, head_size)
                v.copy_(_rope(v.float(), cos, sin, head_size, is_neox))

    class page:  # noqa: N801 - mirrors flashinfer.page
        @staticmethod
        def append_paged_kv_cache(k, v, batch_indices, positions, caches, kv_indices, kv_indptr, last, kv_layout):
            for cache, rows in zip(caches, (k, v)):
                bs = cache.shape[1]
                pos = positions.long()
                pages = kv_indices[kv_indptr[batch_indices.long()].long() + pos // bs].long()
                cache.view(torch.uint8)[pages, pos % bs] = rows.view(torch.uint8)

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, *args, **kwargs):
            pass

        def plan(self, indptr, indices, last, hq, hkv, d, page, **kw):
            n = (indptr[1:] - indptr[:-1]).long()
            self.table = torch.zeros((len(n), int(n.max())), dtype=torch.int32)
            for b in range(len(n)):
                self.table[b, : n[b]] = indices[indptr[b]: indptr[b + 1]]
            self.lens = ((n - 1) * page + last.long()).to(torch.int32)

        def run(self, q, caches, out, k_scale=None, v_scale=None):
            from hpcops.attention.reference import decode_attention

            ks = torch.tensor([k_scale]) if k_scale is not None else None
            vs = torch.tensor([v_scale]) if v_scale is not None else None
            return decode_attention(q, *caches, self.table, self.lens, k_scale=ks, v_scale=vs, out=out)

    class BatchPrefillWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
        def __init__(self, workspace, layout, backend="auto"):
            self.backend = backend

        def plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=False, **kw):
            assert causal
            _FakeFlashInfer.BatchDecodeWithPagedKVCacheWrapper.plan(self, indptr, indices, last, hq, hkv, d, page)
            self.cu = qo_indptr.to(torch.int32)

        def run(self, q, caches, out, k_scale=None, v_scale=None):
            from hpcops.attention._prefill_reference import prefill_attention

            ks = torch.tensor([k_scale]) if k_scale is not None else None
            vs = torch.tensor([v_scale]) if v_scale is not None else None
            return prefill_attention(q, *caches, self.table, self.lens, self.cu, max_seqlen_q=0, k_scale=ks,
                                     v_scale=vs, out=out)


needs_vllm = pytest.mark.skipif(
    not any((d / "vllm_kernels" / "__init__.py").is_file() for d in __import__("hpcops.bench.registry",
                                                                                fromlist=["x"]).peer_dirs()),
    reason="vLLM's Triton kernels are not vendored (no .peers/vllm_kernels; CI has none)")


@needs_vllm
@pytest.mark.parametrize("kv,layout", [("bf16", "ep8"), ("fp8", "tp8")])
def test_baseline_layer_passes_the_gate(tiny_layer, monkeypatch, device, kv, layout):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", _FakeFlashInfer)
    s = suite.Scenario(3, "70,130,65", kv, layout)
    x = suite.make_inputs(s, 0, device=device)
    fn = suite.impl_baseline_rest(s)(x)  # layer 0: the baseline checked against the fp32 reference
    rest = fn()
    hp = suite.hpcops_layer(s, x, suite.plan_for(x), x["hidden"])
    # the same layer both ways: the updates agree to the gate's precision
    upd_b, upd_h = rest.float() - x["hidden"].float(), hp.float() - x["hidden"].float()
    assert (upd_b - upd_h).norm() / upd_h.norm() < 0.06
    kern = suite.impl_baseline_moe_kernels(s)(x)()
    assert kern.shape == (3, suite.HIDDEN) and torch.isfinite(kern.float()).all()
    for step in suite.COMPONENTS:  # every component callable runs on the materialized inputs
        suite.impl_component(s, step)(x)()


@needs_vllm
def test_baseline_prefill_layer_passes_the_gate(tiny_layer, monkeypatch, device):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", _FakeFlashInfer)
    s = suite.Scenario(1, "", "fp8", "tp8", 70)
    x = suite.make_inputs(s, 0, device=device)
    w = suite._fi_wrapper(x)
    assert isinstance(w, _FakeFlashInfer.BatchPrefillWithPagedKVCacheWrapper) and w.backend == "fa2"
    assert w.lens.tolist() == [70] and w.cu.tolist() == [0, 70]
    rest = suite.impl_baseline_rest(s)(x)()  # layer 0: the baseline checked against the fp32 reference
    hp = suite.hpcops_layer(s, x, None, x["hidden"])
    upd_b, upd_h = rest.float() - x["hidden"].float(), hp.float() - x["hidden"].float()
    assert (upd_b - upd_h).norm() / upd_h.norm() < 0.06
    kern = suite.impl_baseline_moe_kernels(s)(x)()
    assert kern.shape == (70, suite.HIDDEN) and torch.isfinite(kern.float()).all()
    for step in suite.COMPONENTS:  # every component callable runs on the prefill's materialized inputs
        out = suite.impl_component(s, step)(x)()
        first = out[0] if isinstance(out, tuple) else out
        assert first.shape[0] == 70
    assert suite._fi_wrapper(suite.make_inputs(suite.Scenario(1, "", "bf16", "tp8", 70), 0, device)).backend == "auto"


def test_merge_split_runs(tmp_path):
    from hpcops.bench import report

    for i, case in enumerate(("B4-u4K-fp8-tp8", "B4-u4K-fp8-ep8")):
        rows = [_row("hpcops", 80.0 + i, case=case), _row("baseline-rest", 70.0, case=case),
                _row("baseline-moe-kernels", 28.0, case=case, timing="kernels")]
        done, _ = rep.finish(SuiteResult("layer", rows, {"copy_gbps": 4000.0}), tmp_path / f"run{i}")
        report.write(done, tmp_path / f"run{i}")
    paths = rep.merge([tmp_path / "run0", tmp_path / "run1"], tmp_path / "all")
    merged = report.load(tmp_path / "all" / "layer.json")
    assert {r.case for r in merged.rows} == {"B4-u4K-fp8-tp8", "B4-u4K-fp8-ep8"}
    assert sum(r.impl == "baseline" for r in merged.rows) == 2  # derived once per case, not duplicated
    assert next(r.us for r in merged.rows if r.impl == "hpcops" and r.case.endswith("ep8")) == 81.0
    assert any(p.name == "layer.components.md" for p in paths)


def test_merge_command_line(tmp_path):
    """`python3 -m hpcops.bench.suites._layer_report OUT RUN...` joins runs; a folder without a layer.json is
    refused by name (exit 2) before anything is written."""
    import subprocess
    import sys

    from hpcops.bench import report

    rows = [_row("hpcops", 80.0), _row("baseline-rest", 70.0), _row("baseline-moe-kernels", 28.0, timing="kernels")]
    done, _ = rep.finish(SuiteResult("layer", rows, {"copy_gbps": 4000.0}), tmp_path / "run0")
    report.write(done, tmp_path / "run0")
    cmd = [sys.executable, "-m", "hpcops.bench.suites._layer_report", str(tmp_path / "all")]
    bad = subprocess.run(cmd + [str(tmp_path / "run0"), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert bad.returncode == 2 and "no layer.json in" in bad.stderr and "nowhere" in bad.stderr
    assert not (tmp_path / "all").exists()
    ok = subprocess.run(cmd + [str(tmp_path / "run0")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "all" / "layer.summary.json").is_file() and "wrote" in ok.stdout


def test_cli_bench_layer_writes_the_derived_reports(monkeypatch, tmp_path, capsys):
    import hpcops.bench
    import hpcops.bench.runner
    from hpcops.cli import main

    def fake_run_suite(name, opts, *, on_case=None, machine=None, **kw):
        assert name == "layer" and opts["quick"]
        rows = [_row("hpcops", 80.0), _row("baseline-rest", 70.0),
                _row("baseline-moe-kernels", 28.0, timing="kernels")]
        res = SuiteResult("layer", rows, machine)
        on_case(res)  # the CLI rewrites the reports after every case
        return res

    monkeypatch.setattr(hpcops.bench, "run_suite", fake_run_suite)
    monkeypatch.setattr(hpcops.bench.runner, "machine_info", lambda: {"copy_gbps": 4000.0})
    assert main(["bench", "layer", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    data = json.loads((tmp_path / "layer.json").read_text())
    assert [r["impl"] for r in data["rows"]] == ["hpcops", "baseline", "baseline-rest", "baseline-moe-kernels"]
    assert (tmp_path / "layer.components.md").is_file() and (tmp_path / "layer.summary.json").is_file()
    assert "| B4-u4K-fp8-tp8 | **hpcops** | 80.0 |" in capsys.readouterr().out


def test_step5_shared_modes(tiny_layer, device):
    """hpcops' shared expert: fused into the routed MoE's kernels at decode sizes (the default), in line above;
    both give the same step 5 up to the shared output's rounding; the auxiliary stream only on a GPU."""
    from hpcops.testing import assert_close

    s = suite.Scenario(3, "70,130,65", "bf16", "tp8")
    x = suite.make_inputs(s, 0, device=device)
    assert suite.shared_mode_for(s.t) == "fused" and suite.shared_mode_for(suite.SHARED_FUSED_MAX_T + 1) == "inline"
    assert suite.shared_on_aux_stream(s.t, x["hidden"].device) == (device == "cuda")
    h1 = x["hidden"] + torch.randn_like(x["hidden"])
    got = {m: suite.hp_step5(s, x, h1, shared_mode=m).clone() for m in ("fused", "inline")}
    assert (got["fused"].float() - h1.float()).abs().max() > 0.1  # the MoE and the shared expert added something
    assert_close(got["inline"].float(), got["fused"].float(), maxtol=2e-2, rmstol=5e-3)
    shared = suite.shared_expert(x, suite._rms(h1, x["w_post"])).float()
    assert (got["fused"].float() - got["inline"].float()).abs().max() < 0.1 * shared.abs().max()
    with pytest.raises(ValueError, match="shared_mode"):
        suite.hp_step5(s, x, h1, shared_mode="stream")
