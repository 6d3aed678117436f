"""The `prefill` bench suite's pure parts on the CPU: batch-spec grammar, FLOP count, case list, and the
correctness gate (sampled reference) on a tiny batch through the interpreter."""

from __future__ import annotations

import pytest
import torch

from hpcops.bench.suites import prefill as suite


def test_parse_batch_spec():
    assert suite.parse_batch_spec("q512") == [(512, 512)]
    assert suite.parse_batch_spec("q1ks2k") == [(1024, 2048)]
    assert suite.parse_batch_spec("2q1ks4k") == [(1024, 4096)] * 2
    assert suite.parse_batch_spec("8q1s1k_q3") == [(1, 1024)] * 8 + [(3, 3)]
    for bad in ("x3", "q", "q4s2", "2q1ks"):
        with pytest.raises(ValueError, match="batch spec"):
            suite.parse_batch_spec(bad)


def test_causal_flops():
    # q_len 2 over seq 5: the queries see 4 and 5 keys
    assert suite.causal_flops([(2, 5)], hq=3, head_dim=8) == 4 * 8 * 3 * 9
    assert suite.causal_flops([(4, 4)], hq=1, head_dim=1) == 4 * 10


def test_cases_list():
    names = [c.name for c in suite.cases({})]
    assert len(names) == len(set(names)) == 2 * len(suite.HEADS) * len(suite.SPECS)
    assert "h64x8-bf16-q8k" in names and "h8x1-fp8-2q1ks4k" in names
    quick = list(suite.cases({"quick": True}))
    assert all(c.check is not None and c.flops > 0 and c.bytes > 0 for c in quick)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gate_on_tiny_batch(fp8: bool, device: str):
    s = suite.Scenario("2q5s40_q17", 4, 2, fp8)
    x = suite._make_inputs(s, 0, device=device)
    suite._check(x)  # raises AssertionError on a mismatch
    x["out"].fill_(0.0)
    rows, heads, want = suite._sampled_reference(x, x["q"], None)
    assert want.abs().max() > 0 and not torch.equal(x["out"][rows][:, heads], want)


def test_config_override(monkeypatch):
    monkeypatch.delenv("HPCOPS_PREFILL_CONFIG", raising=False)
    assert suite.config_override() is None
    assert suite.config_override({"tma": True}) == {"tma": True}
    monkeypatch.setenv("HPCOPS_PREFILL_CONFIG", "block_m=64, num_stages=3,tma=1")
    assert suite.config_override({"pv_fp8": True}) == {"block_m": 64, "num_stages": 3, "tma": True, "pv_fp8": True}
    monkeypatch.setenv("HPCOPS_PREFILL_CONFIG", "tma=auto,heads_inner=1,quant_q=0")
    assert suite.config_override() == {"tma": None, "heads_inner": True, "quant_q": False}


def test_flashinfer_backend_choice():
    """bf16 q over an fp8 cache must not reach FlashInfer's FA3 templates (they fail to compile)."""
    q = torch.zeros(1, 1, 8, dtype=torch.bfloat16)
    assert suite.flashinfer_backend(q, torch.zeros(1, 1, 1, 8, dtype=torch.float8_e4m3fn)) == "fa2"
    assert suite.flashinfer_backend(q, torch.zeros(1, 1, 1, 8, dtype=torch.bfloat16)) == "auto"



@pytest.mark.parametrize("fp8_q,variant", [(False, {"tma": False}), (False, {"quant_q": True}),
                                           (True, {"gluon": False}), (False, {"gluon": False})])
def test_variants_gate_themselves(fp8_q, variant, device, monkeypatch):
    """A variant checks its own output when prepared on layer 0 (so a failing variant marks only its row, not
    the case's defaults); a wrong output raises there, naming the variant."""
    import hpcops.attention.prefill as impl

    s = suite.Scenario("2q5s40_q17", 4, 2, True)
    x = suite._make_inputs(s, 0, device=device)
    run = suite._ours(fp8_q, variant)(x)
    assert run() is not None
    real = impl.prefill_attention

    def off_by_half(*a, **kw):
        return real(*a, **kw).mul_(1.5)

    monkeypatch.setattr(impl, "prefill_attention", off_by_half)
    with pytest.raises(AssertionError, match="variant"):
        suite._ours(fp8_q, variant)(x)
    later = suite._make_inputs(s, 1, device=device)  # other layers are not checked again
    assert callable(suite._ours(fp8_q, variant)(later))


def test_bf16_kv_row_in_the_fp8_case(device, monkeypatch):
    """`hpcops-bf16kv` runs our bf16 default on the fp8 case's shape over its own bf16 cache, gated on layer 0 against
    that cache's reference (a wrong output raises naming the row); the bf16 case has no such row."""
    import hpcops.attention.prefill as impl

    fp8_case = next(c for c in suite.cases({"quick": True}) if "-fp8-" in c.name)
    bf16_case = next(c for c in suite.cases({"quick": True}) if "-bf16-" in c.name)
    assert "hpcops-bf16kv" in [i.name for i in fp8_case.impls]
    assert "hpcops-bf16kv" not in [i.name for i in bf16_case.impls]
    s = suite.Scenario("2q5s40_q17", 4, 2, True)
    x = suite._make_inputs(s, 0, device=device)
    assert "kv16" not in x  # made by the row alone
    out = suite._ours_bf16_kv(x)()
    assert x["kv16"].k_cache.dtype == torch.bfloat16 and x["kv16"].k_cache.shape == x["kv"].k_cache.shape
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    real = impl.prefill_attention
    monkeypatch.setattr(impl, "prefill_attention", lambda *a, **kw: real(*a, **kw).mul_(1.5))
    with pytest.raises(AssertionError, match="hpcops-bf16kv"):
        suite._ours_bf16_kv(x)


def test_variant_with_gluon_knobs_must_ask_for_the_gluon_kernel(device, monkeypatch):
    """A variant that sets Gluon knobs on the tl heuristic (no gluon=True) would time the tl kernel under its
    Gluon name (session 67's hpcops-fp8q-vt3 row did): a ValueError naming the knobs, from the variant dict or from
    HPCOPS_PREFILL_CONFIG; with the Gluon fields it prepares."""
    monkeypatch.delenv("HPCOPS_PREFILL_CONFIG", raising=False)
    s = suite.Scenario("2q5s40_q17", 8, 1, True)
    x = suite._make_inputs(s, 1, device=device)  # layer 1: no self-check, nothing launched
    with pytest.raises(ValueError, match="gluon_persist"):
        suite._ours(True, {"gluon_persist": True})(x)
    monkeypatch.setenv("HPCOPS_PREFILL_CONFIG", "gluon_tree=1")
    with pytest.raises(ValueError, match="gluon_tree"):
        suite._ours(True, {"tma": False})(x)
    monkeypatch.delenv("HPCOPS_PREFILL_CONFIG")
    assert callable(suite._ours(True, {**suite.GLUON_FP8_MSUM, "gluon_persist": True}, check=False)(x))
    assert callable(suite._ours(False, {"gluon": False, "gluon_tree": False})(x))  # knobs off: the tl kernel is meant


@pytest.mark.parametrize("heads", [(64, 8), (8, 1)], ids=lambda h: f"h{h[0]}x{h[1]}")
def test_every_variant_row_resolves_to_a_config_its_kernel_takes(heads, monkeypatch):
    """Every `_ours` row of the suite, at each q4k case, resolves (`variant_config`) to a config the launcher takes:
    a Gluon config its kernel can run at the suite's shapes (`gluon_config_reason` is None), or the tl kernel's.
    Session 68 made the byte-permute transpose the fp8 default, which P in registers cannot take: the
    hpcops-fp8q-gluon-preg row inherited it from the heuristic and errored on the GPU until it turned it off."""
    from hpcops.attention.prefill import FP8_E4M3, gluon_config_reason

    monkeypatch.delenv("HPCOPS_PREFILL_CONFIG", raising=False)
    hq, hkv = heads
    rows = 0
    for case in suite.cases({}):
        if case.params["spec"] != "q4k" or (case.params["hq"], case.params["hkv"]) != heads:
            continue
        for impl in case.impls:
            if not hasattr(impl.prepare, "variant"):
                continue  # a peer, or the in-case bf16 row (its own heuristic)
            variant = impl.prepare.variant
            fp8_q = impl.name.startswith("hpcops-fp8q")
            q_dtype = FP8_E4M3 if fp8_q else torch.bfloat16
            kv_fp8 = case.params["kv"] == "fp8"
            kv_dtype = FP8_E4M3 if kv_fp8 else torch.bfloat16
            cfg = suite.variant_config(variant, group=hq // hkv, max_seqlen_q=4096, q_dtype=q_dtype,
                                       kv_dtype=kv_dtype)
            rows += 1
            if cfg is not None and cfg.gluon:
                why = gluon_config_reason(cfg, fp8=fp8_q and kv_fp8, head_dim=suite.HEAD_DIM,
                                          group=hq // hkv, page=suite.PAGE, elem_bytes=1 if fp8_q else 2)
                assert why is None, (case.name, impl.name, why)
    assert rows >= 20, rows  # both dtypes' cases and the fp8 variants
