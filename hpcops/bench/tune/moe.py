"""`hpcops tune moe`: `MoeConfig` over the `moe` bench suite's scenarios (`hpcops tune moe-shapes`: over the
`moe-shapes` suite's public models); winners into `hpcops/moe/tuned.py`.

Inputs, gate and timing are the suites' (`hpcops.bench.suites._moe_common`): `make_inputs` (each layer its
own weights), `assert_matches` against the torch reference, and the `hpcops-kernels` row's timing (the
profiler's device time of all our kernels; `--timing graph` for the `hpcops` row's graph replay). A
candidate runs as the suites' config rows do (`ours(shape, overrides)`) over the heuristic, with every
tunable field set.

Output: `moe_tuned.json` (`moe-shapes_tuned.json`) = {"device", "entries", "measured", ...}, the entries in the format
`configs.tuned_entry` reads, for the shapes (E, E_local, H, I, quant) where a winner beat the heuristic by
the margin at some batch. In such a shape every measured batch gets an entry (the heuristic's config
where it won), so that the nearest-batch lookup does not carry a neighbour's winner onto a batch where
the heuristic measured best. `HPCOPS_MOE_TUNED=<out>/moe_tuned.json` makes `get_config` (and so the
bench) use it; `--write` (or `--merge FILE` later, without a GPU) rewrites `hpcops/moe/tuned.py`.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import torch

from hpcops.bench.suites import _moe_common as common
from hpcops.bench.suites import moe as suite
from hpcops.bench.tune.engine import ScenarioResult, TuneOp, TuneResult, on_gpu
from hpcops.bench.tune.space import Candidate, knob

# The search space: per MoeConfig field, the values tried around the heuristic's value (its neighbours in
# the list, one field at a time; then the winning moves combined, space.py). Order = priority (`--quick`
# reaches only the first knobs). A new MoeConfig field is one more line, e.g. knob("swap_ab", False, True).
SPACE = (
    knob("naive_max_pairs", values_fn=lambda base, s: _naive_options(base["naive_max_pairs"], s.t * s.top_k)),
    knob("swap_ab", False, True),
    knob("block_n", 16, 32, 64, 128),
    # the gate-up K loop over several programs, at decode batches (where a program's time follows its K steps)
    knob("split_k", values_fn=lambda base, s: tuple(sorted({1, 2, 4, 8, base["split_k"]})) if s.t <= 64
         else (base["split_k"],), near=None),
    # 256-row tiles only where an expert averages 128 rows or more (B >= 4096 at Hy3's top-8 of 192): 25 % fewer
    # tile bytes per MMA for the gate-up, which a sm_90 build shows bound by its tile loads there (one program an
    # SM: 219 registers, 147 KB of shared memory at bf16)
    knob("block_m", values_fn=lambda base, s: (16, 32, 64, 128) + ((256,) if s.t * s.top_k >= 128 * s.e_global
                                                                     else ())),
    knob("down_block_n", 32, 64, 128, 256),
    knob("num_stages", 2, 3, 4, 5),
    knob("down_num_stages", 2, 3, 4, 5),
    knob("block_k", 64, 128, 256),
    knob("down_block_k", 64, 128, 256),
    knob("num_warps", 4, 8),
    knob("down_num_warps", 4, 8),
    knob("prequant_x", False, True),
    # N tiles a down GEMM program walks, at the heuristic's K tile and with one K step over I (down_block_k ≥ I:
    # its activation tile loaded once; the pair Hy3 TP8 fp8 T 16384 measured best)
    knob(("down_n_per", "down_block_k"), values_fn=lambda base, s: _down_walk_options(base, s.inter), near=None),
)

ENTRY_KEYS = ("E", "E_local", "H", "I", "quant", "T")


def _naive_options(heuristic: int, pairs: int) -> tuple[int, ...]:
    """The heuristic's threshold, then the other task form at this batch (one task per pair, or the
    index); none past 2048 pairs, where re-reading an expert's weights once per pair cannot pay."""
    if pairs > 2048:
        return (heuristic,)
    return (heuristic, 0 if pairs <= heuristic else 1 << 30)


def _down_walk_options(base: Candidate, inter: int) -> tuple[tuple[int, int], ...]:
    """(down_n_per, down_block_k) pairs: the heuristic's, 8 and 32 N tiles a program at its K tile, and 32 with
    one K step over I where that step is at most 256 wide."""
    bk = base["down_block_k"]
    opts = [(base["down_n_per"], bk), (8, bk), (32, bk)]
    one = 1 << max(inter - 1, 0).bit_length()  # the power of two ≥ I
    if bk < one <= 256:
        opts.append((32, one))
    return tuple(opts)


def _tunable() -> tuple[str, ...]:
    from hpcops.moe.configs import TUNABLE

    return TUNABLE


class MoeTune(TuneOp):
    """Over the `moe` suite's Hy3 scenarios; any `_moe_common.MoeShape` works (see MoeShapesTune)."""

    name = "moe"
    timing = "kernels"
    space = SPACE
    has_table = True

    def scenarios(self, quick: bool) -> list:
        # not the dynamic-scale cases: a tuned entry is keyed by shape and quant, and they share the static ones'
        return [s for s in suite.scenarios(quick) if not s.dynamic]

    def base(self, s) -> Candidate:
        cfg = common.config_for(s, None, heuristic=True)
        return {f: getattr(cfg, f) for f in _tunable()}

    def valid(self, s, c: Candidate) -> bool:
        if s.kind == "fp8_block":  # MoeConfig: Fp8Block128 needs K tiles of 128 and N tiles dividing 128
            if c["block_k"] != 128 or c["down_block_k"] != 128 or 128 % c["block_n"] or 128 % c["down_block_n"]:
                return False
        # K tiles past I add only masked work, except one K step over I for a down program walking N tiles (its
        # activation tile then loaded once)
        return c["down_block_k"] <= max(64, s.inter) or (c["down_n_per"] > 1 and c["down_block_k"] < 2 * s.inter)

    def extra(self, s, base: Candidate) -> list[Candidate]:
        """The config the current tuned table (hpcops/moe/tuned.py, HPCOPS_MOE_TUNED) picks, if not the heuristic."""
        if not on_gpu():
            return []
        cfg = common.config_for(s, torch.device("cuda"))
        return [{f: getattr(cfg, f) for f in base}]

    def make_inputs(self, s, layer: int, device: str) -> dict[str, Any]:
        return common.make_inputs(s, layer, device)

    def bytes(self, s) -> int:
        return common.traffic(s)[0]

    def params(self, s) -> dict[str, Any]:
        return {"B": s.t, "quant": s.kind, "E_global": s.e_global, "E_local": s.e_local, "top_k": s.top_k,
                "H": s.hidden, "I": s.inter, "ep": s.ep, "shared_output": s.shared}

    def prepare(self, s, cand: Candidate):
        return common.ours(s, cand, heuristic=True)  # every tunable field set: the tuned table plays no part

    def gate(self, s, x: dict[str, Any], cand: Candidate, name: str) -> None:
        x["out"].fill_(float("nan"))  # an element the candidate leaves unwritten fails
        got = common.ours(s, cand, heuristic=True)(x)()
        common.assert_matches(s, x, got, f"hpcops[{name}]")

    def table_notes(self, result: TuneResult) -> dict[str, str]:
        return entries(result)[2]

    def write_table(self, result: TuneResult, out_dir: str) -> Path:
        return write_json(result, out_dir)

    def merge_into_table(self, result: TuneResult) -> str:
        if result.device == "cpu":
            return "--write: nothing merged (a CPU run)"
        es, measured, _ = entries(result)
        n = merge_table(table_path(), result.device, es, measured)
        return (f"merged {len(es)} entries for {result.device!r} into {table_path()} ({n} entries for it now; "
                f"{len(measured)} batches measured)")


OP = MoeTune()


class MoeShapesTune(MoeTune):
    """`hpcops tune moe-shapes`: the same over the `moe-shapes` suite's public models (its layer cap)."""

    name = "moe-shapes"

    def scenarios(self, quick: bool) -> list:
        from hpcops.bench.suites import moe_shapes

        return moe_shapes.scenarios(quick)

    def layers(self, s) -> int:
        from hpcops.bench.suites import moe_shapes

        return moe_shapes.layers(s, self.bytes(s))


SHAPES_OP = MoeShapesTune()


# ---- the tuned table ---------------------------------------------------------------------------------

def _shape(s_params: dict[str, Any]) -> dict[str, Any]:
    return {"E": s_params["E_global"], "E_local": s_params["E_local"], "H": s_params["H"], "I": s_params["I"],
            "quant": s_params["quant"]}


def entry_key(e: dict[str, Any]) -> tuple:
    return (int(e["E"]), int(e.get("E_local", e["E"])), int(e["H"]), int(e["I"]), str(e["quant"]), int(e["T"]))


def entries(result: TuneResult) -> tuple[list[dict], list[list], dict[str, str]]:
    """(entries, measured keys [E, E_local, H, I, quant, T], a note per scenario for the report)."""
    groups: dict[tuple, list[ScenarioResult]] = {}
    for res in result.scenarios:
        if res.rows and res.measured:
            groups.setdefault(tuple(_shape(res.params).values()), []).append(res)
    out, measured, notes = [], [], {}
    for group in groups.values():
        has_winner = any(r.winner for r in group)
        for res in group:
            key = {**_shape(res.params), "T": res.params["B"]}
            measured.append(list(key.values()))
            h = res.heuristic.median_us
            if res.winner:
                row, notes[res.name] = res.best, "winner"
            elif has_winner:
                row, notes[res.name] = res.heuristic, "heuristic (pinned: a batch of this shape has a winner)"
            else:
                notes[res.name] = "—"
                continue
            out.append({**key, "config": dict(row.config), "us": round(row.median_us, 2),
                        "heuristic_us": round(h, 2), "timing": result.timing})
    return out, measured, notes


def tuned_json(result: TuneResult) -> dict[str, Any]:
    es, measured, _ = entries(result)
    return {"device": result.device, "timing": result.timing, "margin": result.margin, "entries": es,
            "measured": measured}


def write_json(result: TuneResult, out_dir: str | Path) -> Path:
    path = Path(out_dir) / f"{result.op}_tuned.json"
    path.write_text(json.dumps(tuned_json(result), indent=1) + "\n")
    return path


def table_path() -> Path:
    import hpcops.moe.tuned as tuned

    return Path(tuned.__file__)


def _literal(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _wrapped(items: list[str], first: str, indent: str, last: str, width: int = 118) -> list[str]:
    """`first` + items joined by ", " + `last`, broken into lines of at most `width` characters."""
    lines, cur = [], first
    for i, item in enumerate(items):
        piece = item + (", " if i + 1 < len(items) else last)
        if len(cur) + len(piece.rstrip()) > width and cur.strip():
            lines.append(cur.rstrip())
            cur = indent
        cur += piece
    lines.append(cur.rstrip())
    return lines


def _ordered(e: dict[str, Any]) -> dict[str, Any]:
    order = list(_tunable())
    cfg = {k: e["config"][k] for k in sorted(e["config"], key=lambda k: (order.index(k) if k in order else 99, k))}
    head = {k: e[k] for k in ENTRY_KEYS if k in e}
    tail = {k: e[k] for k in sorted(e) if k not in ENTRY_KEYS and k != "config"}
    return {**head, "config": cfg, **tail}


def format_table(table: dict[str, list[dict]]) -> str:
    """The `TUNED = {...}` assignment: devices sorted, entries sorted by shape then batch, one field order."""
    lines = ["TUNED: dict[str, list[dict]] = {"]
    for dev in sorted(table):
        lines.append(f"    {_literal(dev)}: [")
        for e in sorted(table[dev], key=lambda e: (e["quant"], *entry_key(e)[:4], entry_key(e)[5])):
            e = _ordered(e)
            head = [f"{_literal(k)}: {_literal(e[k])}" for k in ENTRY_KEYS if k in e]
            lines += _wrapped(head, "        {", "         ", ",")
            cfg = [f"{_literal(k)}: {_literal(v)}" for k, v in e["config"].items()]
            lines += _wrapped(cfg, '         "config": {', "                    ", "},")
            tail = [f"{_literal(k)}: {_literal(v)}" for k, v in e.items() if k not in ENTRY_KEYS and k != "config"]
            lines += _wrapped(tail, "         ", "         ", "},") if tail else ["        },"]
        lines.append("    ],")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _find_table(text: str) -> tuple[ast.stmt, dict[str, list[dict]]]:
    for node in ast.parse(text).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "TUNED" and node.value is not None:
            return node, ast.literal_eval(node.value)
    raise ValueError("no `TUNED = {...}` literal found")


def read_table(path: str | Path) -> dict[str, list[dict]]:
    return _find_table(Path(path).read_text())[1]


def merge_table(path: str | Path, device: str, new: list[dict], measured: list[list]) -> int:
    """Rewrite the TUNED literal of `path` (hpcops/moe/tuned.py): `device`'s entries at the measured
    (shape, batch) keys are replaced by `new` (dropped where `new` has none: the heuristic won there);
    the rest of the file is kept. Returns the number of entries `device` has afterwards."""
    path = Path(path)
    text = path.read_text()
    node, table = _find_table(text)
    gone = {tuple(k) for k in measured} | {entry_key(e) for e in new}
    for e in new:
        unknown = set(e["config"]) - set(_tunable())
        if unknown:
            raise ValueError(f"entry {entry_key(e)}: fields {sorted(unknown)} are not tunable MoeConfig fields")
    kept = [e for e in table.get(device, []) if entry_key(e) not in gone]
    table[device] = kept + [dict(e) for e in new]
    if not table[device]:
        del table[device]
    lines = text.splitlines(keepends=True)
    path.write_text("".join(lines[:node.lineno - 1]) + format_table(table) + "".join(lines[node.end_lineno:]))
    return len(table.get(device, []))


def merge_json(json_path: str | Path, table: str | Path | None = None) -> tuple[str, int, int]:
    """Merge a `moe_tuned.json` into the tuned table; (device, entries merged, entries of the device now)."""
    data = json.loads(Path(json_path).read_text())
    dev = data.get("device") or ""
    if not dev or dev == "cpu":
        raise ValueError(f"{json_path}: no GPU device name (a CPU run has nothing to merge)")
    es = data.get("entries", [])
    n = merge_table(table or table_path(), dev, es, data.get("measured", []))
    return dev, len(es), n
