"""The blog's scenarios as data (DESIGN.md), and the small length grammar they are written in."""

from __future__ import annotations

import re

# Decode (blog table 3): A×B = A requests with KV length B (K = 1024).
DECODE_SCENARIOS = ("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")
DECODE_HEADS = ((8, 1), (64, 8))  # one TP8 rank of Hy3, and the full model


def parse_lengths(spec: str) -> list[int]:
    """'1x128K+31x4K' → [131072] + [4096]*31; also accepts plain comma-separated integers."""
    spec = spec.strip()
    if re.fullmatch(r"\d+(,\d+)*", spec):
        return [int(x) for x in spec.split(",")]
    out: list[int] = []
    for part in spec.split("+"):
        m = re.fullmatch(r"(\d+)x(\d+(?:\.\d+)?)([kK]?)", part.strip())
        if not m:
            raise ValueError(f"bad length spec {part!r} in {spec!r}; expected e.g. 1x128K+31x4K or 100,2000")
        count, value, k = int(m.group(1)), float(m.group(2)), m.group(3)
        length = int(round(value * (1024 if k else 1)))
        out += [length] * count
    return out
