"""The fp8 Gluon prefill's shared-memory layouts against a model of the banks (no GPU, no compiler).

Shared memory has 32 four-byte banks; a warp's access is served a quarter-warp at a time for 16-byte accesses, a
half-warp for 8-byte ones, the whole warp for 4 bytes and less; each phase takes as many wavefronts as the most
distinct words one bank must deliver. The tiles sit under the 128-byte swizzle (the 16-byte chunk c of row r at
chunk c ^ (r % 8)). The model reproduced what Nsight Compute measured on the H200 (ncu_prefill.txt, 844b0c5: 1109
load wavefronts a tile where the model says 1024 for the V loads), so it guards the layouts in CI.
"""

from __future__ import annotations

import itertools

import pytest

gluon = pytest.importorskip("hpcops.attention._prefill_gluon")


def _xor(vectors):
    out = [0, 0]
    for v in vectors:
        out = [out[0] ^ v[0], out[1] ^ v[1]]
    return out


def _coords(layout, reg, lane, warp):
    pick = lambda bases, i: [b for k, b in enumerate(bases) if i >> k & 1]  # noqa: E731
    return _xor(pick(layout.reg_bases, reg) + pick(layout.lane_bases, lane) + pick(layout.warp_bases, warp))


def _address(row, col, row_bytes=128):
    """Byte address of element [row, col] of a tile of 1-byte elements under the NVMMA swizzle of its row size:
    128-byte rows, the 16-byte chunk c at c ^ (row % 8); 64-byte rows, at c ^ (row / 2 % 4)."""
    if row_bytes == 128:
        return row * 128 + ((col // 16) ^ (row % 8)) * 16 + col % 16
    assert row_bytes == 64
    return row * 64 + ((col // 16) ^ (row // 2 % 4)) * 16 + col % 16


def wavefronts(layout, vec_regs: int, row_bytes: int = 128) -> int:
    """Shared-memory wavefronts of all the warp instructions that store (or load) `layout`'s tile, 1-byte elements,
    each instruction a vector of the first `vec_regs` register bits (2^vec_regs contiguous bytes)."""
    vec = 1 << vec_regs
    phase = {16: 8, 8: 16}.get(vec, 32)  # lanes served together
    total = 0
    for warp in range(1 << len(layout.warp_bases)):
        for hi in range(1 << (len(layout.reg_bases) - vec_regs)):
            for first in range(0, 32, phase):
                words: dict[int, set[int]] = {}
                for lane in range(first, first + phase):
                    for lo in range(vec):
                        row, col = _coords(layout, lo | hi << vec_regs, lane, warp)
                        word = _address(row, col, row_bytes) // 4
                        words.setdefault(word % 32, set()).add(word)
                total += max(len(w) for w in words.values())
    return total


def _pi(key: int) -> int:
    """`_permute_keys`' order: key bits (k0 k1 k2 k3 k4 k5 k6) at j bits (3 4 5 0 1 2 6)."""
    return (key >> 3 & 7) | (key & 7) << 3 | (key & 64)


def test_permuted_transpose_is_at_the_minimum():
    """At 128×128 the producer's V loads and Vᵀ stores each take 128 wavefronts a tile (16 KB / 128 B), the
    natural order's 512 + 256 (and 1024 + 256 before the lane order put d 16 first). At 128×64 (64-byte V rows,
    4-byte Vᵀ stores) 64 each."""
    assert gluon._vt_perm(128, 128) and gluon._vt_perm(128, 64) and not gluon._vt_perm(64, 128)
    assert wavefronts(gluon._vt_perm_load_layout(128, 128), 4) == 128
    assert wavefronts(gluon._vt_perm_store_layout(128, 128), 3) == 128
    assert wavefronts(gluon._vt_load_layout(128, 128), 4) == 512
    assert wavefronts(gluon._vt_store_layout(128, 128), 3) == 256
    assert wavefronts(gluon._vt_perm_load_layout(128, 64), 4, row_bytes=64) == 64
    assert wavefronts(gluon._vt_perm_store_layout(128, 64), 2) == 64


@pytest.mark.parametrize("d", [128, 64])
def test_permuted_layouts_hold_the_same_elements(d):
    """The store layout is the load layout relabelled: each thread stores V[key, d] at Vᵀ[d, π(key)], register for
    register, so the convert_layout between them moves no data (the PTX has no shared-memory round trip)."""
    load, store = gluon._vt_perm_load_layout(128, d), gluon._vt_perm_store_layout(128, d)
    # the store's registers list the key bits (contiguous j) first, then d's: store register bit k is the load's
    # register bit perm[k]
    key_bits = [i for i, b in enumerate(load.reg_bases) if b[0]]
    perm = key_bits + [i for i, b in enumerate(load.reg_bases) if not b[0]]
    for warp, lane, reg in itertools.product(range(4), range(32), range(1 << len(perm))):
        key, dd = _coords(load, reg, lane, warp)
        store_reg = sum(1 << k for k, src in enumerate(perm) if reg >> src & 1)
        assert _coords(store, store_reg, lane, warp) == [dd, _pi(key)]


def test_p_store_layout_is_the_accumulator_permuted():
    """A consumer's P [64 rows, 128 keys] in the m64n128 wgmma accumulator's layout (registers k0, row 8, k3–k6;
    lanes k1, k2, rows 1–4; warps rows 16, 32), stored in the order j = π(key) in 16-byte pieces: as many
    wavefronts as the accumulator's 2-byte stores (128), with 8 times fewer instructions."""
    acc = type("Acc", (), dict(reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 64]],
                               lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]]))
    store = gluon._p_perm_store_layout(64, 128)
    perm = [2, 3, 4, 0, 1, 5]  # store register bit k is the accumulator's register bit perm[k]
    for warp, lane, reg in itertools.product(range(4), range(32), range(64)):
        row, key = _coords(acc, reg, lane, warp)
        store_reg = sum(1 << k for k, src in enumerate(perm) if reg >> src & 1)
        assert _coords(store, store_reg, lane, warp) == [row, _pi(key)]
    assert wavefronts(store, 4) == wavefronts(acc, 1) == 128
