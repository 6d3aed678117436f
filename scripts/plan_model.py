"""Compare decode plan cuts on the host, without a GPU: the busiest program's cost under a simple model.

    python scripts/plan_model.py                                   # task cost 0 / 8, snap 0 / 16, split cost
    python scripts/plan_model.py --cuts 0/0,8/0,8/8,12/16 --task-weight 2 --heads 1,8

A cut is `task_cost/snap[/split_cost]` (plan_decode's arguments and DecodeConfig.split_cost, quarters of a
tile; without a split cost, the `tl` kernel's default, which keeps short uniform batches whole). For every
scenario of the decode bench, plus a seeded log-uniform mix of 64 requests (100 to 100K tokens) and a few
uniform batches, the plan is built by the torch reference (`hpcops.attention.reference.plan_decode`, the
kernel's integer arithmetic) with task descriptors on, and each program's cost is modelled as its tiles plus
`--task-weight` tiles per task (every piece of a request it runs). The table shows the busiest program's
cost and, in brackets, the split pieces (each a partial write and a merge). It is a model: it ranks cuts
before a GPU run (`hpcops tune decode --knobs task_cost,snap,min_tiles,split_cost`) decides; on the H200
the measured split cost was larger than a task's (bench/results/README.md, decode).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hpcops.attention import decode as dec  # noqa: E402
from hpcops.attention import reference as ref  # noqa: E402
from hpcops.attention.plan import MAX_SPLIT_COST  # noqa: E402
from hpcops.bench.scenarios import DECODE_SCENARIOS, parse_lengths  # noqa: E402


def scenarios() -> list[tuple[str, list[int]]]:
    rng = random.Random(0)
    logmix = [int(math.exp(rng.uniform(math.log(100), math.log(100_000)))) for _ in range(64)]
    extra = [("logmix64", logmix), ("8x1K", [1024] * 8), ("128x2K", [2048] * 128), ("256x1K", [1024] * 256)]
    return [(s, parse_lengths(s)) for s in DECODE_SCENARIOS] + extra


def busiest(lens: list[int], heads: int, programs: int, min_tiles: int, cut: tuple[int, ...],
            task_weight: float) -> tuple[float, int]:
    """(the busiest program's tiles + task_weight·tasks, split pieces) of one plan."""
    task_cost, snap, *split = cut
    with dec.decode_config_changed(**(dict(split_cost=split[0]) if split else {})):
        plan = ref.plan_decode(torch.tensor(lens, dtype=torch.int32), num_kv_heads=heads, num_programs=programs,
                               min_tiles=min_tiles, task_cost=task_cost, snap=snap)
    load: dict[int, float] = {}
    splits = 0
    for prog, _h, _b, _t0, n, split in plan.tasks():
        load[prog] = load.get(prog, 0.0) + n + task_weight
        splits += split
    return max(load.values()), splits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuts", default="0/0,8/0/0,8/0,8/16",
                   help="task_cost/snap[/split_cost] (default: %(default)s)")
    p.add_argument("--heads", default="1,8", help="kv heads, comma-separated (default: %(default)s)")
    p.add_argument("--programs", type=int, default=264, help="persistent programs (default: %(default)s)")
    p.add_argument("--min-tiles", type=int, default=4, help="the plan's tile floor (default: %(default)s)")
    p.add_argument("--task-weight", type=float, default=2.0,
                   help="modelled cost of one task, in tiles (default: %(default)s)")
    p.add_argument("--only", default=None, help="scenarios whose name contains this text")
    args = p.parse_args(argv)
    try:
        cuts = [tuple(int(v) for v in c.split("/")) for c in args.cuts.split(",")]
        heads = [int(h) for h in args.heads.split(",")]
        if any(len(c) not in (2, 3) or (len(c) == 3 and not 0 <= c[2] <= MAX_SPLIT_COST) for c in cuts):
            raise ValueError
    except ValueError:
        p.error(f"--cuts takes task_cost/snap[/split_cost] such as 0/0,8/16/32 (split_cost 0..{MAX_SPLIT_COST}); "
                "--heads integers")
    with dec.decode_config_changed(task_desc=True):  # the cut in cost needs the task descriptors
        print("| scenario | kv heads | " + " | ".join(f"cost {c[0]}/snap {c[1]}" + (f"/split {c[2]}" if c[2:] else "")
                                                     for c in cuts) + " |")
        print("|---|---:|" + "---:|" * len(cuts))
        for name, lens in scenarios():
            if args.only and args.only not in name:
                continue
            for h in heads:
                cells = [busiest(lens, h, args.programs, args.min_tiles, c, args.task_weight) for c in cuts]
                print(f"| {name} | {h} | " + " | ".join(f"{m:.1f} ({n})" for m, n in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
