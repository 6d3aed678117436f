"""Search spaces of `hpcops tune`: knobs around a heuristic config, and the candidates built from them.

A candidate is a dict {config field: value} holding every field the op tunes (the heuristic's values
for the fields a knob does not change). The search is a coordinate search in two phases:

- phase A (`neighbours`): the heuristic, then each knob moved alone to the values next to the
  heuristic's (within `Knob.near` places in `Knob.values`; every value when the heuristic's is not
  among them), nearest first, knobs in the order of the space (its priority order);
- phase B (`combinations`): the single moves that beat the heuristic, applied together (all of them,
  the best two, the best three, the best pairs), and one more step along the best move's direction.

Phase A needs no measurement, so its kernels compile before anything is timed; phase B is small.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Candidate = dict[str, Any]


@dataclass(frozen=True)
class Knob:
    """Values tried for one config field, or for several fields set together (then each value is a
    tuple, one item per field). `values` may be a function (heuristic candidate, scenario) → values,
    for values relative to the heuristic's or that depend on the shape; an empty result skips the knob.
    `near`: try the values within this many places of the heuristic's (None: every value)."""

    fields: tuple[str, ...]
    values: tuple | Callable[[Candidate, Any], Sequence]
    near: int | None = 1

    def options(self, base: Candidate, scenario: Any) -> tuple:
        vals = self.values(base, scenario) if callable(self.values) else self.values
        return tuple(dict.fromkeys(vals))  # distinct, in order

    def value_of(self, cand: Candidate) -> Any:
        vals = tuple(cand[f] for f in self.fields)
        return vals[0] if len(vals) == 1 else vals

    def apply(self, cand: Candidate, value: Any) -> Candidate:
        vals = (value,) if len(self.fields) == 1 else tuple(value)
        return {**cand, **dict(zip(self.fields, vals))}


def knob(fields: str | tuple[str, ...], *values: Any, near: int | None = 1,
         values_fn: Callable[[Candidate, Any], Sequence] | None = None) -> Knob:
    """`knob("block_n", 16, 32, 64, 128)`; `knob(("block_m", "num_warps"), (128, 8), (64, 4), near=None)`;
    `knob("block_kv", values_fn=lambda base, s: ...)` for values computed per scenario."""
    names = (fields,) if isinstance(fields, str) else tuple(fields)
    if values_fn is not None and values:
        raise ValueError("knob: give values or values_fn, not both")
    return Knob(names, values_fn if values_fn is not None else tuple(values), near)


def key(cand: Candidate) -> tuple:
    """A hashable identity of a candidate (its fields sorted by name)."""
    return tuple(sorted(cand.items()))


def label(cand: Candidate, base: Candidate) -> str:
    """The fields that differ from the heuristic's, e.g. `block_n=64 num_stages=3`; `heuristic` if none."""
    diff = [f"{k}={_fmt(v)}" for k, v in cand.items() if base.get(k) != v]
    return " ".join(diff) or "heuristic"


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    return "auto" if v is None else str(v)


def _moves(knob_: Knob, base: Candidate, scenario: Any) -> list[list[Any]]:
    """The values of one knob to try, grouped by distance from the heuristic's value (nearest first)."""
    opts = knob_.options(base, scenario)
    cur = knob_.value_of(base)
    if cur not in opts or knob_.near is None:
        rest = [v for v in opts if v != cur]
        return [rest] if rest else []
    i = opts.index(cur)
    out = []
    for d in range(1, knob_.near + 1):
        ring = [opts[j] for j in (i - d, i + d) if 0 <= j < len(opts)]
        if ring:
            out.append(ring)
    return out


def neighbours(base: Candidate, space: Iterable[Knob], scenario: Any,
               valid: Callable[[Candidate], bool] = lambda c: True, limit: int | None = None) -> list[Candidate]:
    """Phase A: the heuristic first, then one knob at a time, by distance ring then knob order (so a
    short `limit` still visits the first knobs' nearest values). Invalid and repeated candidates are
    dropped; at most `limit` candidates (the heuristic included)."""
    space = list(space)
    rings = [_moves(k, base, scenario) for k in space]
    out, seen = [base], {key(base)}
    for d in range(max((len(r) for r in rings), default=0)):
        for k, r in zip(space, rings):
            for v in r[d] if d < len(r) else ():
                c = k.apply(base, v)
                if key(c) not in seen and valid(c):
                    seen.add(key(c))
                    out.append(c)
    return out[:limit] if limit is not None else out


def moved_knob(cand: Candidate, base: Candidate, space: Iterable[Knob]) -> Knob | None:
    """The knob a phase-A candidate moves (None for the heuristic or a candidate moving several)."""
    changed = {k for k, v in cand.items() if base.get(k) != v}
    return next((k for k in space if changed and changed <= set(k.fields)), None)


def combinations(base: Candidate, timed: Sequence[tuple[Candidate, float]], base_us: float,
                 space: Iterable[Knob], scenario: Any, valid: Callable[[Candidate], bool] = lambda c: True,
                 *, limit: int = 6, gain: float = 0.01, seen: Iterable[tuple] = ()) -> list[Candidate]:
    """Phase B from the phase-A times `timed` [(candidate, µs)]: the best improving value of each knob
    (faster than the heuristic by more than `gain`), best first; then candidates applying the best 2,
    all, the best 3 of them, the pairs among the best 3, and the best move one step further. At most
    `limit`, none already in `seen`."""
    space = list(space)
    best: dict[Knob, tuple[float, Any]] = {}
    for cand, us in timed:
        k = moved_knob(cand, base, space)
        if k is not None and us < base_us * (1 - gain) and (k not in best or us < best[k][0]):
            best[k] = (us, k.value_of(cand))
    ranked = sorted(best.items(), key=lambda kv: kv[1][0])
    moves = [(k, v) for k, (_, v) in ranked]

    def applied(ms) -> Candidate:
        c = dict(base)
        for k, v in ms:
            c = k.apply(c, v)
        return c

    out: list[Candidate] = []
    if len(moves) >= 2:
        out += [applied(moves[:2]), applied(moves)]
        if len(moves) >= 3:
            out.append(applied(moves[:3]))
            out += [applied(p) for p in itertools.combinations(moves[:3], 2)]
    if moves:  # the best move one place further in the same direction, with the other winners
        k, v = moves[0]
        opts = k.options(base, scenario)
        cur = k.value_of(base)
        if cur in opts and v in opts:
            i, j = opts.index(cur), opts.index(v)
            step = j + (1 if j > i else -1)
            if 0 <= step < len(opts):
                out.append(applied([(k, opts[step])] + moves[1:]))
    keys = set(seen)
    uniq = []
    for c in out:
        if key(c) not in keys and valid(c):
            keys.add(key(c))
            uniq.append(c)
    return uniq[:limit]
