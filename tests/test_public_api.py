import hpcops

EXPECTED = {
    "DecodePlan", "plan_decode", "decode_attention", "prefill_attention", "rope_norm_store_kv",
    "fused_moe", "select_experts", "route", "Fp8PerTensor", "Fp8Block128", "__version__",
}


def test_all_is_pinned():
    assert set(hpcops.__all__) == EXPECTED


def test_unknown_attribute_raises():
    try:
        hpcops.no_such_op  # noqa: B018
    except AttributeError as exc:
        assert "no_such_op" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_route_is_exported_with_its_reference():
    import inspect

    from hpcops.moe import reference

    assert hpcops.route is hpcops.moe.route
    params = lambda f: [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    assert params(hpcops.route) == params(reference.route)
