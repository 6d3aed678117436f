import hpcops

EXPECTED = {
    "DecodePlan", "plan_decode", "decode_attention", "prefill_attention", "rope_norm_store_kv", "store_kv",
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


def test_moe_package_imports_in_a_fresh_process():
    """`from hpcops.moe import fused_moe` is the submodule (the function is `hpcops.fused_moe`), and every name of
    `hpcops.moe.__all__` resolves, in a fresh interpreter (a lazy package attribute named like the submodule
    recursed there until the submodule happened to be imported)."""
    import subprocess
    import sys

    code = ("import hpcops, hpcops.moe as m\n"
            "from hpcops.moe import fused_moe\n"
            "assert fused_moe.__name__ == 'hpcops.moe.fused_moe' and fused_moe.fused_moe is hpcops.fused_moe\n"
            "assert all(getattr(m, n) is not None for n in m.__all__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
