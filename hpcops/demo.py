"""`hpcops demo` and `hpcops plan`: what the load-balanced decode schedule does, on any machine."""

from __future__ import annotations

import os
import sys
import time

import torch

from hpcops.attention.decode import static_splits
from hpcops.attention.plan import DEFAULT_MIN_TILES, TILE, default_num_programs, enumerate_tasks
from hpcops.bench.scenarios import DECODE_SCENARIOS, parse_lengths

BARS = " ▁▂▃▄▅▆▇█"


def _tiles(n: int) -> int:
    return max(1, -(-n // TILE))


def dynamic_loads(lens: list[int], num_kv_heads: int, num_programs: int, min_tiles: int) -> list[int]:
    """Tiles per program under the dynamic plan (host arithmetic identical to the device kernel)."""
    tiles = [_tiles(n) for n in lens]
    s = sum(tiles)
    total = s * num_kv_heads
    bucket = max(-(-total // num_programs), min_tiles)
    return [max(0, min(bucket, total - i * bucket)) for i in range(num_programs)]


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


def sparkline(loads: list[int], width: int = 64) -> str:
    if not loads:
        return ""
    step = max(1, -(-len(loads) // width))
    cols = [max(loads[i:i + step]) for i in range(0, len(loads), step)]
    top = max(cols) or 1
    return "".join(BARS[min(8, round(8 * c / top))] for c in cols)


def schedule_table(num_sms: int = 132, num_kv_heads: int = 1) -> list[dict]:
    rows = []
    c = default_num_programs(1, None)
    slots = c  # programs resident at once (the persistent grid is sized to be resident)
    for spec in DECODE_SCENARIOS:
        lens = parse_lengths(spec)
        dyn = dynamic_loads(lens, num_kv_heads, c, DEFAULT_MIN_TILES)
        sta = static_loads(lens, num_kv_heads, num_sms)
        active = [x for x in dyn if x]
        rows.append(dict(spec=spec, dyn=dyn, sta=sta, dyn_max=max(dyn), dyn_mean=sum(active) / len(active),
                         sta_max=max(sta), sta_mean=sum(x for x in sta if x) / max(1, sum(1 for x in sta if x)),
                         dyn_span=makespan(dyn, slots), sta_span=makespan(sta, slots)))
    return rows


def _check_small() -> str:
    """A small interpreted (CPU) or native (GPU) correctness run of both schedules vs the reference."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("no GPU: set TRITON_INTERPRET=1 before importing triton (the CLI does this)")
    import hpcops
    from hpcops.attention import reference as ref
    from hpcops.testing import assert_close, make_paged_kv

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [700, 3, 64, 65, 130]
    kv = make_paged_kv(lens, num_kv_heads=2, head_dim=64, block_size=16, device=dev, packed=True)
    q = torch.randn(len(lens), 8, 64, device=dev).to(torch.float16)
    kv.k_cache, kv.v_cache = kv.k_cache.half(), kv.v_cache.half()
    want = ref.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens)
    plan = hpcops.plan_decode(kv.seq_lens, num_kv_heads=2, block_size=16, num_programs=6, min_tiles=1)
    for schedule in ("dynamic", "static"):
        got = hpcops.decode_attention(q, kv.k_cache, kv.v_cache, kv.block_table, kv.seq_lens,
                                      plan=plan if schedule == "dynamic" else None, schedule=schedule)
        assert_close(want, got, name=f"decode ({schedule})")
    return f"{'native' if dev == 'cuda' else 'interpreted'}: dynamic and static match the torch reference " \
           f"(5 requests {lens}, GQA 4, page 16, 6 programs with {len(plan.tasks())} tasks)"


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


def run_demo(check: bool = True, png: str | None = None) -> int:
    num_sms = 132
    print("hpcops demo — load-balanced paged decode (H200-sized grid: 132 SMs, one TP8 rank of Hy3: h8/1)\n")
    print(f"Every KV sequence is cut into {TILE}-token tiles; the dynamic plan splits the tile stream into equal")
    print(f"buckets over {default_num_programs(1, None)} persistent programs (≥ {DEFAULT_MIN_TILES} tiles each); "
          "the static schedule\nsplits every request into the same number of chunks (classic split-KV).\n")
    rows = schedule_table(num_sms)
    hdr = f"{'scenario':18s} {'static max/mean':>16s} {'dynamic max/mean':>17s} {'busiest slot: static/dynamic':>30s}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        gain = r["sta_span"] / max(1, r["dyn_span"])
        print(f"{r['spec']:18s} {r['sta_max']:7d}/{r['sta_mean']:<8.1f} {r['dyn_max']:8d}/{r['dyn_mean']:<8.1f} "
              f"{r['sta_span']:10d}/{r['dyn_span']:<6d} tiles ({gain:4.1f}x)")
    print("\nPer-program tiles (each column = max over a group of programs):")
    for r in rows:
        print(f"  {r['spec']:16s} static  |{sparkline(r['sta'])}|")
        print(f"  {'':16s} dynamic |{sparkline(r['dyn'])}|")
    if png:
        _plot(rows, png)
        print(f"\nwrote {png}")
    status = 0
    if check:
        t = time.time()
        try:
            print("\ncorrectness: " + _check_small() + f" [{time.time() - t:.1f}s]")
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
              num_programs=args.num_programs, min_tiles=args.min_tiles)
    if torch.cuda.is_available():
        plan = hpcops.plan_decode(sl.cuda(), **kw)
    else:
        plan = ref.plan_decode(sl, **kw)  # the identical tables, without the interpreter's start-up
    bucket, s, total, active = plan.host_tables()["header"]
    tasks = enumerate_tasks(plan.host_tables()["cum"], bucket, s, total, plan.num_programs)
    print(f"{len(lens)} requests, {sum(lens)} KV tokens, {args.num_kv_heads} kv heads: {total} tiles of {TILE}; "
          f"{plan.num_programs} programs, bucket {bucket} tiles, {active} active, {len(tasks)} tasks, "
          f"{sum(1 for t in tasks if t[5])} split pieces")
    print(f"{'program':>7s} {'head':>4s} {'request':>7s} {'tiles':>11s} {'split':>5s}")
    for i, (prog, h, b, t0, n, split) in enumerate(tasks):
        if i == 40 and len(tasks) > 48:
            print(f"{'...':>7s} ({len(tasks) - 48} more)")
        if 40 <= i < len(tasks) - 8 and len(tasks) > 48:
            continue
        print(f"{prog:7d} {h:4d} {b:7d} {t0:5d}..{t0 + n - 1:<5d} {'yes' if split else '':>5s}")
    sys.stdout.flush()
    return 0
