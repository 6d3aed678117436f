"""scripts/probe_prefill_trace.py's analysis on the CPU: a synthetic trace of known phases (32-bit counters that
wrap in the middle) gives back those phases, the SMs' timeline and the clock rate; the kernel's stamps themselves
are built for sm_90 in tests/test_prefill_compile.py (`*-trace`) and run on the GPU by the probe."""

import numpy as np
import pytest
from conftest import load_script

TILES, STEPS_A_TILE = 2, 3  # loop steps a tile (n = 4 K/V tiles: the first S is before the loop)
TILE_GAP = 10_000  # cycles from one tile's start to the next's


def _trace(probe, fp8: bool, wrap: int) -> np.ndarray:
    """Two persistent programs (SM 7 and SM 3), two tiles each; program p starts 100·p cycles late; cycles run at
    2 GHz (ns = cycles / 2); every counter is offset by `wrap` modulo 2^32."""
    tr = np.full((2, 3, probe.KINDS, probe.STEPS), np.iinfo(np.int64).min, dtype=np.int64)
    for p in range(2):
        for i in range(TILES):
            k0 = 1000 + i * TILE_GAP + 100 * p
            k1 = k0 + 500
            k2 = k1 + STEPS_A_TILE * 1000
            for role in (0, 1):
                tr[p, role, 0, i], tr[p, role, 1, i], tr[p, role, 2, i] = k0, k1, k2
                tr[p, role, 3, i], tr[p, role, 4, i] = k2 + 300, k2 + 500
                tr[p, role, 6, i], tr[p, role, 7, i] = k0 // 2, (k2 + 500) // 2
                for j in range(STEPS_A_TILE):
                    r = i * (STEPS_A_TILE + 1) + j  # the ring step (a tile of n K/V tiles takes n of them)
                    t = k1 + j * 1000
                    for kind, dt in ((8, 0), (9, 100), (10, 200), (11, 300), (12, 500), (13, 800), (14, 1000)):
                        if kind != 10 or fp8:
                            tr[p, role, kind, r] = t + dt
            tr[p, 2, 0, i] = k0 - 400
            tr[p, 2, 1, i] = k0 - 100
            for j in range(STEPS_A_TILE + 1):
                r = i * (STEPS_A_TILE + 1) + j
                t = k0 + j * 900
                tr[p, 2, 8, r], tr[p, 2, 9, r], tr[p, 2, 10, r], tr[p, 2, 11, r] = t, t + 50, t + 150, t + 450
        tr[p, 0, 5, 0] = 7 if p == 0 else 3
    missing = tr == np.iinfo(np.int64).min
    smid = tr[:, 0, 5, 0].copy()
    wrapped = ((tr + wrap) % 2**32).astype(np.uint32).view(np.int32)
    wrapped[:, 0, 5, 0] = smid
    wrapped[missing] = probe.MISSING
    return wrapped


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("wrap", [0, 2**32 - 3000])
def test_analyse_recovers_the_phases(fp8, wrap):
    probe = load_script("probe_prefill_trace")
    r = probe.analyse(_trace(probe, fp8, wrap), persistent=True, fp8=fp8)
    tile = r["tile_cycles"]
    assert tile["first S+softmax"]["median"] == 500 and tile["loop"]["median"] == STEPS_A_TILE * 1000
    assert tile["last P.V"]["median"] == 300 and tile["epilogue"]["median"] == 200
    assert tile["whole tile"]["median"] == 500 + STEPS_A_TILE * 1000 + 500
    assert tile["gap to next tile"]["median"] == TILE_GAP - (500 + STEPS_A_TILE * 1000 + 500)
    steps = r["step_cycles"]
    assert steps["step"] == {"c0": 1000, "c1": 1000}
    assert steps["S wait"]["c0"] == 200 and steps["softmax"]["c1"] == 300 and steps["P.V wait + P"]["c0"] == 200
    if fp8:
        assert steps["wait Vt"]["c0"] == 100 and steps["turn"]["c0"] == 100
        prod = r["producer_cycles"]
        assert (prod["wait V"], prod["wait Vt buffer"], prod["transpose"], prod["step"]) == (50, 100, 300, 450)
        assert prod["first loads + first Vt + publish"] == 300
    else:
        assert steps["turn"]["c0"] == 200 and "producer_cycles" not in r
    assert r["sms"] == 2 and r["tiles_per_sm"] == {"min": TILES, "max": TILES}
    assert r["mhz"] == pytest.approx(2000, rel=1e-3)
    # the global timer: SM 3 (program 1) starts 50 ns after SM 7, both end with their second tile
    assert r["sm_first_start_us"]["max"] == pytest.approx(0.05)
    last_end_ns = (1000 + TILE_GAP + 100 + 500 + STEPS_A_TILE * 1000 + 500) // 2 - 500
    assert r["sm_last_end_us"]["max"] == pytest.approx(last_end_ns / 1e3)
    # per SM: the latest is SM 3 (program 1, 100 cycles late), with both tiles' steps and their segments summed
    late = r["sm_rows"][-1]
    assert late["sm"] == 3 and late["tiles"] == TILES and late["steps"] == TILES * STEPS_A_TILE
    assert late["end_us"] == pytest.approx(last_end_ns / 1e3) and late["step"] == TILES * STEPS_A_TILE * 1000
    assert late["epilogue"] == TILES * 200
