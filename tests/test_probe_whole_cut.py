"""scripts/probe_whole_cut.py on the CPU (interpreter): every cut of a small case runs, its output matches the
model cut's, and the report names the cut the default plan made."""

import pytest
from conftest import load_script


def _probe():
    return load_script("probe_whole_cut")


@pytest.mark.parametrize("case, whole", [("4x0.25K h8/1", True), ("2x2K h8/1", False), ("4x0.25K h8/1 fp8", True)])
def test_probe_cases_and_report(case, whole):
    pytest.importorskip("triton")
    from hpcops import _platform

    if not _platform.is_interpreter():
        pytest.skip("the CPU tier runs this under TRITON_INTERPRET=1")
    probe = _probe()
    calls = []

    def timer(fns, replays):
        for fn in fns:
            fn()
        calls.append(len(fns))
        return float(len(calls))

    row = probe.time_case(case, rounds=2, device="cpu", timer=timer, layers=1)
    assert len(calls) == 2 * 4 and set(row["us"]) == {"model", "equal", "whole", "static"}
    assert row["cut"]["whole"]["whole"] and not row["cut"]["equal"]["whole"]
    assert row["cut"]["model"]["whole"] is whole
    md = probe.markdown([row], "cpu")
    assert f"| {case} | {'whole' if whole else 'equal'} (bucket" in md


def test_probe_case_names():
    probe = _probe()
    assert probe._case("16x2K h64/8") == ("16x2K", 64, 8, False)
    assert probe._case("64x0.5K h8/1 fp8") == ("64x0.5K", 8, 1, True)
    for bad in ("64x0.5K h8/1 bf16", "64x0.5K", "64x0.5K 8/1", "64x0.5K h8", "64x0.5K hx/1"):
        with pytest.raises(ValueError, match="--cases"):
            probe._case(bad)
    assert all(len(c.split()) == 2 for c in probe.CASES.split(","))
