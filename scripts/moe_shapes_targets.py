"""The two targets of `hpcops bench moe-shapes` per case, from its JSON report (no GPU needed).

heuristic: `hpcops-heuristic` / `vllm-triton` ≤ 1.0; tuned: `hpcops-kernels` / `vllm-triton` ≤ 0.8
(both timed as the device time of their kernels per call, same run, same inputs).

    python scripts/moe_shapes_targets.py bench/results/moe-shapes.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="moe-shapes.json written by `hpcops bench moe-shapes --out DIR`")
    args = p.parse_args(argv)
    from hpcops.bench import report
    from hpcops.bench.suites.moe_shapes import targets_markdown

    result = report.load(args.report)
    print(f"# moe-shapes targets ({result.machine.get('gpu', '?')})\n")
    print(targets_markdown(result.rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
