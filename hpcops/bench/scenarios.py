"""The blog's scenarios as data (DESIGN.md), and the small length grammar they are written in."""

from __future__ import annotations

import math
import re
from fractions import Fraction

# Decode (blog table 3): A×B = A requests with KV length B (K = 1024).
DECODE_SCENARIOS = ("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")
DECODE_HEADS = ((8, 1), (64, 8))  # one TP8 rank of Hy3, and the full model
# The blog's table-4 decode rows, vLLM's benchmark specs 8q1s1k, 16q1s2k, 32q1s1k, 64q1s4k (requests of one new
# token over 1K-4K of context), at h64/8 bf16; 64q1s4k is the 64x4K scenario above
TABLE4_DECODE = ("8x1K", "16x2K", "32x1K", "64x4K")


# Limits of the length grammar, checked before a spec is expanded (a typo such as 99999999999x1 must
# not allocate a list of 10^11 ints): far past any serving batch (vLLM's max_num_seqs is 256-1024
# by default) and any model's context. `hpcops plan` states them in its --help.
MAX_REQUESTS = 16384
MAX_KV_LEN = 1 << 24  # tokens per request (16384K)
_EXAMPLE = "expected e.g. 1x128K+31x4K (COUNTxLENGTH terms, LENGTH in tokens or K = 1024 tokens) or 100,2000"


def parse_lengths(spec: str) -> list[int]:
    """'1x128K+31x4K' → [131072] + [4096]*31; also accepts plain comma-separated integers.

    Raises ValueError (one line, naming the bad part) on a malformed spec, on more than
    `MAX_REQUESTS` requests, or on a length above `MAX_KV_LEN` tokens.
    """
    spec = spec.strip()
    if not spec:
        raise ValueError(f"empty length spec; {_EXAMPLE}")
    if re.fullmatch(r"\d+(,\d+)*", spec):
        terms = [(1, int(x)) for x in spec.split(",")]
    else:
        terms = []
        for part in spec.split("+"):
            m = re.fullmatch(r"(\d+)x(\d+(?:\.\d+)?)([kK]?)", part.strip())
            if not m:
                raise ValueError(f"bad length spec {part!r} in {spec!r}; {_EXAMPLE}")
            count, value, k = int(m.group(1)), Fraction(m.group(2)), m.group(3)  # exact: no float overflow
            terms.append((count, round(value * (1024 if k else 1))))
    num = sum(count for count, _ in terms)
    if num > MAX_REQUESTS:
        raise ValueError(f"length spec {spec!r} has {num} requests; at most {MAX_REQUESTS} are supported")
    longest = max((length for count, length in terms if count), default=0)
    if longest > MAX_KV_LEN:
        raise ValueError(f"length spec {spec!r} has a KV length of {longest} tokens; at most {MAX_KV_LEN} "
                         f"({MAX_KV_LEN // 1024}K) per request are supported")
    out: list[int] = []
    for count, length in terms:
        out += [length] * count
    return out


def log_uniform_lens(b: int, lo: int, hi: int, seed: int) -> list[int]:
    """`b` KV lengths drawn log-uniformly from [lo, hi] tokens with a seeded CPU generator (the same list on
    every machine): the mixed-context batch of the `layer` suite and the decode grid."""
    import torch  # here: the CLI reads this module's limits without loading torch

    g = torch.Generator().manual_seed(seed)
    a, z = math.log(lo), math.log(hi)
    return [int(round(math.exp(a + (z - a) * u))) for u in torch.rand(b, generator=g).tolist()]
