#!/usr/bin/env bash
# Same-run A/B timing of two trees (METHOD.md: compare within one run): an older commit's hpcops/ against the
# working tree's, through `hpcops bench`, interleaved.
#
#   bash scripts/ab_bench.sh prepare REV              here (needs git): REV's hpcops/ into .base/ (git-ignored)
#   bash scripts/ab_bench.sh run SUITE ONLY [ROUNDS]  on the GPU, .base carried: ROUNDS (default 2) of
#                                                     base, new; each `hpcops bench SUITE --only ONLY`; then:
#   bash scripts/ab_bench.sh summary SUITE ROUNDS     the table of what run wrote under $OUT/ab
#
# e.g. the device tool's command `bash scripts/ab_bench.sh run decode '64x0.5K h8/1,64x4K h8/1 bf16' 2` with
# carry [".base"]. Writes $OUT/ab/{base,new}_<round>/ (the bench's files) and $OUT/ab/ab.md: our rows, each round's
# µs and new / base of the medians. Rows the two trees both report only; peers run if installed (not needed).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${AB_BASE:-$ROOT/.base}  # the base tree's folder (tests point it elsewhere)
OUT=${OUT:-$ROOT/out}
case "${1:-}" in
  prepare)
    rev=${2:?usage: ab_bench.sh prepare REV}
    rm -rf "$BASE" && mkdir -p "$BASE"
    git archive "$rev" hpcops | tar -x -C "$BASE" || exit 1
    git rev-parse --short "$rev" > "$BASE/REV"
    echo "base $(cat "$BASE/REV"): $BASE/hpcops" ;;
  run)
    suite=${2:?usage: ab_bench.sh run SUITE ONLY [ROUNDS]}
    only=${3:?usage: ab_bench.sh run SUITE ONLY [ROUNDS]}
    rounds=${4:-2}
    [ -d "$BASE/hpcops" ] || { echo "no $BASE/hpcops: run 'ab_bench.sh prepare REV' here and carry .base" >&2; exit 2; }
    mkdir -p "$OUT/ab"
    export PYTHONUNBUFFERED=1
    for i in $(seq 1 "$rounds"); do
      for t in base new; do
        d=$ROOT; [ "$t" = base ] && d=$BASE
        # `python -m` puts the folder it runs in first on sys.path: each tree imports its own hpcops
        (cd "$d" && python3 -m hpcops bench "$suite" --only "$only" --out "$OUT/ab/${t}_$i" --no-progress 2>&1 \
          | tail -1)
      done
    done
    bash "$0" summary "$suite" "$rounds" ;;
  summary)
    suite=${2:?usage: ab_bench.sh summary SUITE ROUNDS}
    rounds=${3:?usage: ab_bench.sh summary SUITE ROUNDS}
    python3 - "$OUT/ab" "$suite" "$rounds" "$(cat "$BASE/REV" 2>/dev/null || echo base)" <<'PY'
import json
import os
import statistics
import sys

folder, suite, rounds, rev = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
times = {}  # (case, impl) -> {"base": [...], "new": [...]}
for i in range(1, rounds + 1):
    for tree in ("base", "new"):
        path = os.path.join(folder, f"{tree}_{i}", f"{suite}.json")
        if not os.path.exists(path):
            continue
        for r in json.load(open(path))["rows"]:
            if r.get("ours") and r.get("us"):
                times.setdefault((r["case"], r["impl"]), {"base": [], "new": []})[tree].append(r["us"])
lines = [f"# A/B: {rev} (base) against the working tree (new), {suite}, {rounds} rounds interleaved", "",
         "| case | impl | base µs | new µs | new / base |", "|---|---|---|---|---:|"]
for (case, impl), t in times.items():
    if t["base"] and t["new"]:
        ratio = statistics.median(t["new"]) / statistics.median(t["base"])
        base, new = (" / ".join(f"{x:.1f}" for x in t[tree]) for tree in ("base", "new"))
        lines.append(f"| {case} | {impl} | {base} | {new} | {ratio:.3f} |")
open(os.path.join(folder, "ab.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
    ;;
  *) echo "usage: ab_bench.sh prepare REV | run SUITE ONLY [ROUNDS] | summary SUITE ROUNDS" >&2; exit 2 ;;
esac
