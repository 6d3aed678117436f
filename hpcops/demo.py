"""`hpcops demo` and `hpcops plan`: what the load-balanced decode schedule does, on any machine."""

from __future__ import annotations

import sys
import textwrap
import time

import torch

from hpcops._platform import DEFAULT_NUM_SMS, is_interpreter
from hpcops.attention.decode import static_splits
from hpcops.attention.plan import (
    DEFAULT_MIN_TILES,
    DEFAULT_PROGRAMS_PER_SM,
    DEFAULT_SNAP,
    DEFAULT_TASK_COST,
    SPLIT_COST_TL,
    TASK_UNITS,
    TILE,
    WHOLE_SNAP,
    CostStream,
    split_cost_for,
)
from hpcops.bench.scenarios import DECODE_SCENARIOS, parse_lengths

BARS = " ▁▂▃▄▅▆▇█"


def _tiles(n: int) -> int:
    return max(1, -(-n // TILE))


def dynamic_loads(lens: list[int], num_kv_heads: int, num_programs: int, min_tiles: int,
                  task_cost: int = DEFAULT_TASK_COST, snap: int = DEFAULT_SNAP) -> list[int]:
    """Tiles per program under the dynamic plan (host arithmetic identical to the device kernel)."""
    cs = _cut(lens, num_kv_heads, num_programs, min_tiles, task_cost, snap)
    return [b - a for a, b in map(cs.program_range, range(num_programs))]


def _cut(lens: list[int], num_kv_heads: int, num_programs: int, min_tiles: int, task_cost: int,
         snap: int) -> CostStream:
    """The dynamic plan's cut of `lens` (the plan without dtype hints: the tl kernel's split cost)."""
    cum = [0]
    for n in lens:
        cum.append(cum[-1] + _tiles(n))
    return CostStream.cut(cum, num_kv_heads, task_cost, num_programs, min_tiles, snap if task_cost else 0,
                          split_cost_for("tl") if task_cost else 0, num_sms=-(-num_programs // DEFAULT_PROGRAMS_PER_SM))


def static_loads(lens: list[int], num_kv_heads: int, num_sms: int) -> list[int]:
    """Tiles per program of the static split-KV grid (B, Hkv, splits)."""
    splits = static_splits(len(lens), num_kv_heads, None) if num_sms is None else \
        max(1, min(64, -(-2 * num_sms // max(1, len(lens) * num_kv_heads))))
    out = []
    for n in lens:
        t = _tiles(n)
        chunk = -(-t // splits)
        for _ in range(num_kv_heads):
            out += [max(0, min(chunk, t - s * chunk)) for s in range(splits)]
    return out


def makespan(loads: list[int], slots: int) -> int:
    """Tiles streamed by the busiest of `slots` concurrent program slots (greedy, in launch order)."""
    import heapq

    heap = [0] * slots
    for w in loads:
        if w:
            heapq.heappush(heap, heapq.heappop(heap) + w)
    return max(heap)


def sparkline(loads: list[int], width: int = 64, top: int | None = None) -> str:
    """`loads` as exactly `width` bar glyphs: column j shows the max over its share of the programs,
    scaled to `top` (default: the max load). Any non-zero load shows at least the lowest bar; only
    zero (an idle program) is blank."""
    if not loads:
        return " " * width
    n = len(loads)
    top = top or max(loads) or 1
    cols = []
    for j in range(width):
        lo = j * n // width
        cols.append(max(loads[lo:max(lo + 1, (j + 1) * n // width)]))
    return "".join(BARS[min(8, max(1, round(8 * c / top)))] if c > 0 else BARS[0] for c in cols)


def schedule_table(num_sms: int = DEFAULT_NUM_SMS, num_kv_heads: int = 1) -> list[dict]:
    """Per scenario: tiles per program of both schedules, and the tiles of the busiest slot."""
    rows = []
    c = slots = DEFAULT_PROGRAMS_PER_SM * num_sms  # the persistent grid is sized to be resident: one per slot
    for spec in DECODE_SCENARIOS:
        lens = parse_lengths(spec)
        dyn = dynamic_loads(lens, num_kv_heads, c, DEFAULT_MIN_TILES)
        sta = static_loads(lens, num_kv_heads, num_sms)
        dyn_on, sta_on = [x for x in dyn if x], [x for x in sta if x]
        rows.append(dict(spec=spec, dyn=dyn, sta=sta, tiles=sum(dyn), dyn_n=len(dyn_on), sta_n=len(sta_on),
                         dyn_max=max(dyn), dyn_mean=sum(dyn_on) / max(1, len(dyn_on)),
                         sta_max=max(sta), sta_mean=sum(sta_on) / max(1, len(sta_on)),
                         dyn_span=makespan(dyn, slots), sta_span=makespan(sta, slots)))
    return rows


def _check_small() -> str:
    """A small interpreted (CPU) or native (GPU) correctness run of both schedules vs the reference."""
    if not torch.cuda.is_available() and not is_interpreter():
        raise RuntimeError("no GPU: set TRITON_INTERPRET=1 before importing triton (the CLI does this)")
    import hpcops
    from hpcops.attention import reference as ref
    from hpcops.testing import TOLERANCES, assert_close, make_paged_kv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype, hq, hkv, d, page = torch.float16, 8, 2, 64, 16
    lens = [700, 3, 64, 65, 130]
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv(lens, num_kv_heads=hkv, head_dim=d, block_size=page, dtype=dtype, device=dev,
                       packed=True, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype).to(dev)
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens)
    plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=hkv, block_size=page, num_programs=6, min_tiles=1)
    for schedule in ("dynamic", "static"):
        got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens,
                                      plan=plan if schedule == "dynamic" else None, schedule=schedule)
        assert_close(want, got, name=f"decode ({schedule})")
    tol_max, tol_rms = TOLERANCES[dtype]
    return (f"{'native' if dev == 'cuda' else 'interpreted'}: dynamic and static decode match the torch "
            f"reference within the fp16 tolerance (relative max/rms error ≤ {tol_max:g}/{tol_rms:g}): q fp16 "
            f"[{len(lens)}, {hq}, {d}], KV cache fp16 (packed K|V, pages of {page}, {hkv} kv heads: GQA "
            f"{hq // hkv}), out fp16; requests of {lens} tokens, {plan.num_programs} programs, "
            f"{len(plan.tasks())} tasks")


def _time_on_gpu() -> list[str]:
    from hpcops.bench import run_suite

    res = run_suite("decode", {"layers": 8}, only="h8/1 fp8", progress=False)
    lines = []
    by = {}
    for r in res.rows:
        by.setdefault(r.case, {})[r.impl] = r.us
    for case, d in by.items():
        dy, st = d.get("hpcops"), d.get("hpcops-static")
        fi = [v for k, v in d.items() if k.startswith("flashinfer") and v]
        extra = f", FlashInfer best {min(fi):.1f} µs" if fi else ""
        if dy and st:
            lines.append(f"  {case:28s} dynamic {dy:7.1f} µs  static {st:7.1f} µs  ({st / dy:.2f}x){extra}")
    return lines


def _legend(num_sms: int, programs: int) -> list[str]:
    per_sm = programs // num_sms
    return [
        "Legend",
        "  h8/1     8 query heads sharing 1 KV head: one tensor-parallel rank of Hy3 (Tencent's Hunyuan 3,",
        "           64 q / 8 kv heads, split over TP8). One program handles all 8 q heads of its KV head, so",
        "           the work is counted in KV tiles.",
        f"  tile     {TILE} tokens of one request's KV cache (one KV head): the unit of work below.",
        f"  program  one thread block of a kernel's grid. The dynamic plan launches {programs} persistent programs,",
        "           each walking its bucket of tiles; the static split launches one program per",
        "           (request, KV head, chunk).",
        f"  slot     one of the {programs} places where a program runs at a time ({per_sm} per SM × {num_sms} SMs, the",
        "           model used here); programs beyond that wait for a slot to free up and run after.",
        "  64x4K    64 requests of 4K (4096) KV tokens each; '+' joins groups.",
        "",
    ]


def _notes(rows: list[dict], programs: int) -> list[str]:
    """Say in words what the table's columns and its odd rows mean, with the numbers computed above."""
    notes = ["max/mean: tiles of the busiest program / mean over the programs with work. Busiest slot: the "
             "tiles that the slot finishing last streams one program after the other, i.e. the step's time "
             "in this model; gain = static / dynamic."]
    queued = next((r for r in rows if r["sta_span"] > r["sta_max"]), None)
    if queued:
        notes.append(f"{queued['spec']}: the static grid has {queued['sta_n']} programs of ≤ {queued['sta_max']} "
                     f"tiles for {programs} slots, so {queued['sta_n'] - programs} slots run two of them in turn "
                     f"({queued['sta_span']} tiles); the dynamic plan never has more programs than slots, so "
                     "its busiest slot is its busiest program.")
    for r in rows:
        if r["dyn_span"] > r["sta_span"] and _whole_cut(r["spec"], programs):
            notes.append(f"{r['spec']}: short uniform requests. The plan keeps each one whole ({r['dyn_n']} programs "
                         f"of {r['dyn_max']} tiles, {programs - r['dyn_n']} idle) where splitting would save less "
                         f"than it costs: a split request's partials are written, merged by a second kernel and "
                         f"waited for, which the plan charges as {SPLIT_COST_TL / TASK_UNITS:g} tiles on the busiest "
                         "SM (DecodeConfig.split_cost). So in tiles it reads "
                         f"{r['sta_span'] / r['dyn_span']:.2f}x against the static split's {r['sta_n']} programs of "
                         f"≤ {r['sta_max']} (and its merge); in time, on the H200, the whole cut runs 64x0.5K h8/1 "
                         "bf16 in 11.5 µs against the static split's 12.4 (over fp8 KV with a bf16 q it is still "
                         "slower: 13.5 against 11.8; bench/results/decode.md).")
        elif r["dyn_span"] > r["sta_span"]:
            even = -(-r["tiles"] // programs)
            notes.append(f"{r['spec']}: short uniform requests are already balanced by the static split "
                         f"({r['sta_n']} programs of ≤ {r['sta_max']} tiles). The plan's floor of {DEFAULT_MIN_TILES} "
                         f"tiles per program (against over-splitting small batches) puts the {r['tiles']} tiles on "
                         f"{r['dyn_n']} programs of {r['dyn_max']} and leaves {programs - r['dyn_n']} idle, hence "
                         f"{r['sta_span'] / r['dyn_span']:.1f}x (without the floor: {even} tiles per program, as "
                         "even as the static split). Tile counts, not times: see bench/results/decode.md.")
    return [line for n in notes for line in textwrap.wrap(n, 100)]


def _whole_cut(spec: str, programs: int) -> bool:
    """Whether the demo's plan of one kv head (`dynamic_loads`) cuts `spec` whole (no request split)."""
    return _cut(parse_lengths(spec), 1, programs, DEFAULT_MIN_TILES, DEFAULT_TASK_COST, DEFAULT_SNAP).snap == WHOLE_SNAP


def run_demo(check: bool = True, png: str | None = None) -> int:
    num_sms = DEFAULT_NUM_SMS
    programs = DEFAULT_PROGRAMS_PER_SM * num_sms
    print(f"hpcops demo — load-balanced paged decode (H200-sized grid: {num_sms} SMs, heads h8/1)\n")
    print("\n".join(_legend(num_sms, programs)))
    print("\n".join(textwrap.wrap(
        f"Every KV sequence is cut into {TILE}-token tiles; the dynamic plan splits the tile stream into buckets "
        f"of equal cost over {programs} persistent programs (≥ {DEFAULT_MIN_TILES} tiles each; a request's start "
        f"costs {DEFAULT_TASK_COST / TASK_UNITS:g} tile{'' if DEFAULT_TASK_COST == TASK_UNITS else 's'} more: its "
        "query load and its first tile's latency); the "
        "static schedule splits every request into the same number of chunks (classic split-KV).", 100)) + "\n")
    rows = schedule_table(num_sms)
    hdr = f"{'scenario':16s}  {'programs with work':18s}  {'tiles per program, max/mean':27s}  busiest slot, tiles"
    sub = f"{'':16s}  {'static/dynamic':18s}  {'static':13s} {'dynamic':13s}  static dynamic   gain"
    print(hdr)
    print(sub)
    print("-" * len(hdr))
    for r in rows:
        gain = r["sta_span"] / max(1, r["dyn_span"])
        print(f"{r['spec']:16s}  {r['sta_n']:>6d}/{r['dyn_n']:<11d}  {r['sta_max']:5d}/{r['sta_mean']:<7.1f} "
              f"{r['dyn_max']:5d}/{r['dyn_mean']:<7.1f}  {r['sta_span']:6d} {r['dyn_span']:7d} {gain:5.1f}x")
    print()
    print("\n".join(_notes(rows, programs)))
    print("\nTiles per program, static and dynamic on one scale per scenario (█ = the scenario's busiest")
    print("program; any non-zero load shows at least ▁, blank = idle; each column = the max over a group of")
    print("programs; on the right: the busiest program's tiles):")
    for r in rows:
        top = max(r["sta_max"], r["dyn_max"])
        for name, key in (("static", "sta"), ("dynamic", "dyn")):
            label = r["spec"] if key == "sta" else ""
            print(f"  {label:16s} {name:7s} |{sparkline(r[key], top=top)}| {r[key + '_max']:3d}")
    if png:
        _plot(rows, png)
        print(f"\nwrote {png}")
    status = 0
    if check:
        t = time.time()
        try:
            line = "correctness: " + _check_small() + f" [{time.time() - t:.1f}s]"
            print("\n" + textwrap.fill(line, 100, subsequent_indent="  "))
        except AssertionError as exc:
            print(f"\ncorrectness: FAILED: {exc}")
            status = 1
    if torch.cuda.is_available() and status == 0:
        print("\nGPU timings (µs per layer, CUDA-graph replay, L2-cold; hpcops bench decode for the full table):")
        for line in _time_on_gpu():
            print(line)
    elif not torch.cuda.is_available():
        print("\nNo GPU here: timings come from `hpcops bench decode` on a GPU (see bench/results/decode.md).")
    return status


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 1.6 * len(rows)), sharey="row")
    for i, r in enumerate(rows):
        for j, key in enumerate(("sta", "dyn")):
            ax = axes[i][j]
            ax.bar(range(len(r[key])), r[key], width=1.0, color="tab:red" if key == "sta" else "tab:blue")
            ax.set_title(f"{r['spec']} — {'static' if key == 'sta' else 'dynamic'}", fontsize=8)
            ax.tick_params(labelsize=6)
    fig.supylabel("tiles per program")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_plan(args) -> int:
    import hpcops
    from hpcops.attention import reference as ref

    lens = args.lengths if isinstance(args.lengths, list) else parse_lengths(args.lengths)
    sl = torch.tensor(lens, dtype=torch.int32)
    kw = dict(num_kv_heads=args.num_kv_heads, q_len=args.q_len, block_size=args.block_size,
              num_programs=args.num_programs, min_tiles=args.min_tiles, task_cost=args.task_cost, snap=args.snap)
    from hpcops.attention.decode import decode_config_changed

    split_cost = getattr(args, "split_cost", None)
    with decode_config_changed(**({} if split_cost is None else dict(split_cost=split_cost))):
        if torch.cuda.is_available():
            plan = hpcops.plan_decode(sl.cuda(), **kw)
        else:
            plan = ref.plan_decode(sl, **kw)  # the identical tables, without the interpreter's start-up
    bucket, s, total, active = plan.host_tables()["header"]
    whole = plan.host_tables()["used_snap"] == WHOLE_SNAP
    tasks = plan.tasks()
    cost = plan.cut_task_cost
    size = f"bucket {bucket} tiles" if not cost else f"bucket {bucket / 4:g} tiles of cost (a task costs {cost / 4:g})"
    print(f"{len(lens)} requests, {sum(lens)} KV tokens, {args.num_kv_heads} kv heads: {s * args.num_kv_heads} tiles "
          f"of {TILE}; {plan.num_programs} programs, {size}, {active} active, {len(tasks)} tasks, "
          f"{sum(1 for t in tasks if t[5])} split pieces" + (" (whole requests: splitting would cost more)" if whole
                                                              else ""))
    print(f"{'program':>7s} {'head':>4s} {'request':>7s} {'tiles':>11s} {'split':>5s}")
    for i, (prog, h, b, t0, n, split) in enumerate(tasks):
        if i == 40 and len(tasks) > 48:
            print(f"{'...':>7s} ({len(tasks) - 48} more)")
        if 40 <= i < len(tasks) - 8 and len(tasks) > 48:
            continue
        print(f"{prog:7d} {h:4d} {b:7d} {t0:5d}..{t0 + n - 1:<5d} {'yes' if split else '':>5s}")
    sys.stdout.flush()
    return 0
