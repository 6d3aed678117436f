"""The GPU-run plumbing that can be checked without a GPU: the test-tier report and the smoke stage."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _junit(tmp_path, name: str, body: str) -> None:
    (tmp_path / f"test_{name}.py").write_text(textwrap.dedent(body))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"test_{name}.py",
                    f"--junitxml={tmp_path / 'reports' / f'junit_test_{name}.xml'}"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120)


def _report(tmp_path, files: list[str]):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_tests_report.py"), str(tmp_path / "reports"),
                           "--rev", "abc123", "--versions", "torch X, triton Y", "--files", ",".join(files)],
                          capture_output=True, text=True, timeout=60)


def test_gpu_tests_report_counts_skips_failures_and_missing_reports(tmp_path):
    _junit(tmp_path, "a", """
        import pytest
        def test_ok(): pass
        def test_ok2(): pass
        @pytest.mark.skip(reason="needs two GPUs")
        def test_skip(): pass
    """)
    (tmp_path / "test_c.py").write_text("import pytest\npytest.importorskip('no_such_module_here')\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_c.py",
                    f"--junitxml={tmp_path / 'reports' / 'junit_test_c.xml'}"], cwd=tmp_path, capture_output=True,
                   timeout=120)
    _junit(tmp_path, "b", """
        import pytest
        def test_fail(): assert 1 == 2
        @pytest.fixture
        def broken(): raise RuntimeError("setup broke")
        def test_error(broken): pass
    """)
    res = _report(tmp_path, ["tests/test_a.py", "tests/test_b.py", "tests/test_c.py", "tests/test_crashed.py"])
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert lines[0] == "tree: abc123" and lines[1] == "versions: torch X, triton Y"
    assert "summary: 2 passed, 1 failed, 2 errors, 2 skipped" in lines  # the crashed file is an error
    assert "   1 × needs two GPUs" in lines
    assert "   1 × could not import 'no_such_module_here': No module named 'no_such_module_here'" in lines
    assert any(line.startswith("tests/test_crashed.py: no report") for line in lines)
    assert any(line.startswith("FAILED test_b::test_fail") for line in lines)


def test_gpu_tests_report_clean_run_exits_0(tmp_path):
    _junit(tmp_path, "a", "def test_ok(): pass\n")
    res = _report(tmp_path, ["tests/test_a.py"])
    assert res.returncode == 0, res.stdout
    assert "summary: 1 passed, 0 failed, 0 errors, 0 skipped" in res.stdout


def test_smoke_stage_covers_every_gpu_script():
    """Every GPU tool has a smallest run in gpu_check.sh's `smoke` stage: `hpcops tune <op> --smoke` for every
    tunable op (tuning lives in the harness: no stand-alone sweep scripts), profile_decode.py under ncu;
    `tune:<ops>` runs full tunes."""
    from hpcops.bench.tune import OPS

    with open(os.path.join(SCRIPTS, "gpu_check.sh")) as f:
        sh = f.read()
    smoke = sh[sh.index("    smoke)"):]
    smoke = smoke[:smoke.index(";;")]
    tuned = set(re.search(r"for s in ([a-z -]+); do", smoke).group(1).split())
    assert tuned == set(OPS)
    assert 'python3 -m hpcops tune "$s" --smoke' in smoke
    assert "profile_decode.py" in smoke
    assert not [f for f in os.listdir(SCRIPTS) if f.startswith("sweep_")]
    assert "    tune:*)" in sh and 'python3 -m hpcops tune "$o" --out "$OUT/results"' in sh


@pytest.mark.parametrize("op", ["decode", "decode-grid", "moe", "moe-shapes", "rope", "prefill", "prefill-gluon"])
def test_tune_has_a_smoke_run(op, capsys):
    """`hpcops tune OP --smoke` narrows the tune to one scenario, 2 candidates (listed with --dry-run, no GPU)."""
    from hpcops.cli import main

    assert main(["tune", op, "--dry-run"]) == 0
    full = capsys.readouterr().out
    assert main(["tune", op, "--dry-run", "--smoke"]) == 0
    smoke = capsys.readouterr().out
    assert 0 < len(smoke.splitlines()) < len(full.splitlines())
    assert f"{op}: 1 scenarios" in smoke and "2 phase-A candidates" in smoke


def test_profile_moe_help_and_gpu_check_stage():
    """The MoE per-kernel profiler parses its options and names an unknown scenario without a GPU, and gpu_check.sh
    has its stage."""
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "profile_moe.py"), "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr
    assert "--configs" in res.stdout and "--only" in res.stdout
    with open(os.path.join(SCRIPTS, "gpu_check.sh")) as f:
        assert "profile:moe)" in f.read()
    # a name that matches no scenario is an error naming the known ones (it once profiled nothing, exit 0)
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "profile_moe.py"), "--only", "tp8-fp8t"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode != 0 and "unknown scenario(s) 'tp8-fp8t'" in res.stderr and "B4-tp8-fp8t" in res.stderr


def test_profile_decode_kernels_options_and_gpu_check_stage():
    """The decode step profiler parses its variants and names an unknown scenario without a GPU; gpu_check.sh
    has its stage."""
    sys.path.insert(0, SCRIPTS)
    try:
        import profile_decode_kernels as prof
    finally:
        sys.path.remove(SCRIPTS)
    assert prof.parse_variant("gluon=1 pps=3 schedule=static") == {"gluon": 1, "pps": 3, "schedule": "static"}
    with pytest.raises(ValueError, match="not key=value"):
        prof.parse_variant("gluon")
    # DecodeConfig's bools from 0 / 1 (any of them: pdl_wait failed as an int), the plan's arguments to plan_decode
    knobs, plan_args = prof.split_variant(prof.parse_variant("pdl_wait=0 split_cost=0 min_tiles=2 pps=1 lean_loop=1"))
    assert knobs == {"pdl_wait": False, "split_cost": 0, "lean_loop": True} and plan_args == {"min_tiles": 2}
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "profile_decode_kernels.py"), "--only", "nope"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode != 0 and "unknown scenario 'nope'" in res.stderr
    with open(os.path.join(SCRIPTS, "gpu_check.sh")) as f:
        assert "profile:decode-kernels)" in f.read()


def test_profile_prefill_options_and_gpu_check_stage():
    """The prefill profiler (for ncu) parses its options and says it needs a GPU, or refuses --gluon without an fp8
    q; gpu_check.sh has its stage, which profiles the bf16 and the fp8 default (both Gluon kernels on an H200),
    shared-memory wavefronts and bank conflicts included, and fp8 variants beside them (PROFILE_CONFIGS)."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "profile_prefill.py"), "--help"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0 and "--gluon" in res.stdout and "--spec" in res.stdout, res.stderr
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "profile_prefill.py"), "--gluon"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode != 0 and "--gluon is for --q fp8" in res.stderr
    with open(os.path.join(SCRIPTS, "gpu_check.sh")) as f:
        text = f.read()
    stage = text[text.index("profile:prefill)"):]
    stage = stage[:stage.index(";;")]
    assert "${PROFILE_QS:-bf16 fp8}" in stage and "bank_conflicts_pipe_lsu_mem_shared_op_st" in stage
    assert "PROFILE_CONFIGS" in stage and "HPCOPS_PREFILL_CONFIG=$c" in stage
    assert stage.count('profile_prefill.py --q "$q" ${PROFILE_SHAPE:-}') == 1  # the case reaches both ncu runs
    assert stage.count("profile_prefill.py --q fp8 ${PROFILE_SHAPE:-}") == 1


FAKE_CHECK = """#!/usr/bin/env bash
# a stand-in for gpu_check.sh: results/ packed into results.tar.gz, as the real one does
mkdir -p "$OUT/results"
echo "stage $1 gpu=$CUDA_VISIBLE_DEVICES args=${BENCH_ARGS:-}" > "$OUT/gpu.txt"
case "$1" in
  setup) exit 0 ;;
  slow) echo partial > "$OUT/results/partial.md"; sleep 60 ;;
  fail) exit 3 ;;
  *) echo "$1" > "$OUT/results/$1.md" ;;
esac
tar -czf "$OUT/results.tar.gz" -C "$OUT" results && rm -rf "$OUT/results"
"""


def test_gpu_parallel_queues_timeouts_and_one_archive(tmp_path):
    """Queues run side by side on their GPUs, per-job environment and timeouts hold, a timed-out job keeps what it
    wrote, and $OUT ends with all.tgz + the summaries only (the device tool returns at most 8 files)."""
    import json
    import tarfile

    fake = tmp_path / "check.sh"
    fake.write_text(FAKE_CHECK)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "gpu_parallel.py"), "--check", f"bash {fake}", "--limit", "60",
         "tests ; BENCH_ARGS='--only fp8 --quick' bench:prefill", "timeout=2 slow ; fail"],
        env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr  # one job failed, one timed out
    assert sorted(p.name for p in out.iterdir()) == ["all.tgz", "summary.json", "summary.txt"]
    jobs = {(j["gpu"], j["stage"]): j for j in json.loads((out / "summary.json").read_text())}
    assert jobs[(0, "tests")]["status"] == jobs[(0, "bench:prefill")]["status"] == "ok"
    assert jobs[(1, "slow")]["status"].startswith("timeout") and jobs[(1, "slow")]["seconds"] < 20
    assert jobs[(1, "fail")]["status"] == "failed (rc 3)"
    with tarfile.open(out / "all.tgz") as t:
        names = set(t.getnames())
        gpu_txt = t.extractfile("gpu0-1-bench_prefill/gpu.txt").read().decode()
    assert {"gpu0-0-tests/results/tests.md", "gpu1-0-slow/results/partial.md"} <= names
    assert gpu_txt.strip() == "stage bench:prefill gpu=0 args=--only fp8 --quick"


def test_gpu_parallel_keeps_a_quoted_semicolon_in_its_job():
    """`;` separates a queue's jobs only outside quotes: profile_decode_kernels' --variants list keeps its own."""
    from conftest import load_script

    gp = load_script("gpu_parallel")
    jobs = gp.parse_queue(1, "PROFILE_ARGS='--variants \"tail_merge=1;gluon=0\"' profile:decode-kernels ;"
                             " timeout=300 bench:decode;bench:moe")
    assert [(j.stage, j.env, j.timeout) for j in jobs] == [
        ("profile:decode-kernels", {"PROFILE_ARGS": '--variants "tail_merge=1;gluon=0"'}, None),
        ("bench:decode", {}, 300.0), ("bench:moe", {}, None)]


def test_gpu_parallel_rejects_a_bad_queue():
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_parallel.py"), "bench:decode bench:moe"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "one stage a job" in proc.stderr


def test_plan_model_ranks_cuts_on_the_host():
    """scripts/plan_model.py: the busiest program under the tiles + tasks model, from the reference plans; the
    cost cut relieves the short-request mix at h64/8, the equal-tile cut keeps 64x0.5K h64/8 unsplit, the cost cut
    splits it unless a split cost keeps it whole (the third cut: the tl kernel's default)."""
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "plan_model.py"), "--cuts", "0/0,8/0/0,8/0",
                          "--heads", "8", "--only", "K"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = {ln.split("|")[1].strip(): ln for ln in res.stdout.splitlines() if ln.startswith("| ") and "---" not in ln}
    cell = lambda name, i: float(rows[name].split("|")[3 + i].split()[0])  # noqa: E731
    assert cell("32x0.125K+32x4K", 0) == 64 + 2 * 32 and cell("32x0.125K+32x4K", 1) <= 70
    assert "(0)" in rows["64x0.5K"].split("|")[3] and "(0)" not in rows["64x0.5K"].split("|")[4]
    assert "(0)" in rows["64x0.5K"].split("|")[5] and "(0)" not in rows["32x0.125K+32x4K"].split("|")[5]
    bad = subprocess.run([sys.executable, os.path.join(SCRIPTS, "plan_model.py"), "--cuts", "8"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--cuts" in bad.stderr


def test_gluon_decode_probe_compiles_for_sm90():
    """scripts/probe_gluon_decode.py (issue 10's Hopper decode probe) builds for sm_90 without a GPU: fp8 wgmma for
    Kᵀ·q and bf16 for Vᵀ·P (12 wgmma a tile), TMA tile loads, no spill. Its numbers come from the H200."""
    pytest.importorskip("triton.backends.nvidia")
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "probe_gluon_decode.py"), "--compile-only",
                          "--stages", "3"], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["wgmma"] == 12 and got["tma_loads"] == 7 and got["spill_bytes"] == 0 and 0 < got["registers"] <= 128


def test_ab_bench_prepare_and_summary(tmp_path):
    """scripts/ab_bench.sh: `prepare REV` puts REV's hpcops/ in the base folder; `summary` tables our rows of both
    trees' bench files, each round's µs and new / base of the medians (peers' rows left out)."""
    script = os.path.join(SCRIPTS, "ab_bench.sh")
    env = {**os.environ, "AB_BASE": str(tmp_path / "base"), "OUT": str(tmp_path / "out")}
    res = subprocess.run(["bash", script, "prepare", "HEAD"], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "base" / "hpcops" / "__init__.py").exists() and (tmp_path / "base" / "REV").read_text().strip()
    for tree, us in (("base", [10.0, 12.0]), ("new", [9.0, 11.0])):
        for i, u in enumerate(us, 1):
            d = tmp_path / "out" / "ab" / f"{tree}_{i}"
            d.mkdir(parents=True)
            rows = [{"case": "c1", "impl": "hpcops", "ours": True, "us": u},
                    {"case": "c1", "impl": "peer", "ours": False, "us": 1.0}]
            (d / "decode.json").write_text(json.dumps({"rows": rows}))
    res = subprocess.run(["bash", script, "summary", "decode", "2"], capture_output=True, text=True, timeout=60,
                         env=env)
    assert res.returncode == 0, res.stderr
    table = (tmp_path / "out" / "ab" / "ab.md").read_text()
    assert "| c1 | hpcops | 10.0 / 12.0 | 9.0 / 11.0 | 0.909 |" in table and "peer" not in table
    res = subprocess.run(["bash", script, "run", "decode", "x"], capture_output=True, text=True, timeout=60,
                         env={**env, "AB_BASE": str(tmp_path / "none")})
    assert res.returncode == 2 and "prepare REV" in res.stderr


def _script(name: str):
    """scripts/<name>.py imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _decode_targets():
    return _script("decode_targets")


def _write_report(tmp_path, suite: str, machine: dict, rows: list[dict]):
    """A suite report `<suite>.json` as the bench writes it (suite, machine, rows) in tmp_path; its path."""
    path = tmp_path / f"{suite}.json"
    path.write_text(json.dumps(dict(suite=suite, machine=machine, rows=rows)))
    return path


def _decode_report(tmp_path, scale_bf16: float = 1.0):
    """A decode report: FlashInfer's best 1.2x our time on every h8/1 bf16 row (flashinfer-decode slower still),
    1.6x on the fp8q rows, the dynamic plan 1.05x its static split on 64x0.5K h8/1 fp8 only."""
    rows = []

    def row(case, impl, us, nbytes=0):
        rows.append(dict(suite="decode", case=case, impl=impl, ours=impl.startswith("hpcops"), us=us, status="ok",
                         bytes=nbytes))

    for i, s in enumerate(("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")):
        ours = 10.0 + i
        row(f"{s} h8/1 bf16", "hpcops", ours * scale_bf16, nbytes=int(4e3 * ours))  # floor: 0.4 x ours at 10 GB/s
        row(f"{s} h8/1 bf16", "hpcops-static", ours)
        row(f"{s} h8/1 bf16", "flashinfer-tc", 1.2 * ours)
        row(f"{s} h8/1 bf16", "flashinfer-decode", 3.0 * ours)
        row(f"{s} h8/1 fp8", "hpcops", ours * (1.05 if s == "64x0.5K" else 1.0))
        row(f"{s} h8/1 fp8", "hpcops-static", ours)
        row(f"{s} h8/1 fp8", "hpcops-fp8q", ours / 1.6 * 1.2)
        row(f"{s} h8/1 fp8", "flashinfer-tc", 1.2 * ours)
    row("64x0.5K h8/1 bf16", "flashinfer-tc", 99.0)  # a failed peer row is not counted
    rows[-1]["status"] = "error: boom"
    return _write_report(tmp_path, "decode", dict(gpu="G", copy_gbps=10.0), rows)


def test_decode_targets_groups_and_flags(tmp_path):
    dt = _decode_targets()
    machine, cases = dt.load(_decode_report(tmp_path))
    md = dt.targets_markdown(cases)
    assert "| h8/1 bf16 geomean (6 of 6) | 1.200 | >= 1.3 | **short** |" in md
    assert "| h8/1 fp8 geomean (6 of 6) | 1.600 | >= 1.5 | pass |" in md
    assert "| lowest single h8/1 row | 1.200 | >= 1.1 | pass |" in md
    assert "| dynamic / static, worst case | 1.050 | <= 1.03 | **short** | 64x0.5K h8/1 fp8" in md
    assert "| table 4 8x1K h64/8 bf16 | — |" in md  # not in this report: named, not passed


def test_decode_targets_floor_cut_reaches_the_goal(tmp_path):
    dt = _decode_targets()
    machine, cases = dt.load(_decode_report(tmp_path))
    md = dt.floor_markdown(machine, cases, "h8/1 bf16", 1.3)
    assert "Geomean bound (every case at its floor): 3.000" in md  # peer 1.2x ours, floor 0.4x ours
    rows = [(10.0 + i, 1.2 * (10.0 + i), 0.4 * (10.0 + i)) for i in range(6)]
    cut = dt.needed_cut(rows, 1.3)
    assert 0 < cut < 2
    assert dt.geomean([p / max(f, o - cut) for o, p, f in rows]) == pytest.approx(1.3, rel=1e-6)
    assert f"A call {cut:.2f} µs shorter in every case" in md
    assert dt.needed_cut(rows, 3.5) is None  # past every case's floor
    assert dt.needed_cut(rows, 1.1) == 0.0


def test_decode_targets_rejects_other_reports(tmp_path):
    dt = _decode_targets()
    bad = tmp_path / "moe.json"
    bad.write_text(json.dumps(dict(suite="moe", machine={}, rows=[])))
    with pytest.raises(ValueError, match="not a decode bench report"):
        dt.load(bad)
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "decode_targets.py"), str(_decode_report(tmp_path)),
                          "--floor-group", "h8 bf16"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--floor-group must be" in res.stderr


def _prefill_targets():
    return _script("prefill_targets")


def _prefill_report(tmp_path):
    """A prefill report: our bf16 1.1x faster than FlashInfer and 0.8x cuDNN's speed at h64/8 q4k, cuDNN absent at
    h8/1 q4k; the fp8q rows 1.25x (h64/8) and 1.4x (h8/1) our bf16 at q4k; q8k not run."""
    rows = []

    def row(case, impl, us, flops=0, status="ok", sm_mhz=None):
        rows.append(dict(suite="prefill", case=case, impl=impl, ours=impl.startswith("hpcops"), us=us, status=status,
                         flops=flops, sm_mhz=sm_mhz))

    row("h64x8-bf16-q4k", "hpcops", 100.0, flops=int(5e10))
    row("h64x8-bf16-q4k", "flashinfer", 110.0)
    row("h64x8-bf16-q4k", "sdpa-cudnn", 80.0)
    row("h64x8-fp8-q4k", "hpcops-fp8q", 80.0, flops=int(5e10))
    row("h8x1-bf16-q4k", "hpcops", 50.0)
    row("h8x1-bf16-q4k", "flashinfer", 60.0)
    row("h8x1-bf16-q4k", "sdpa-cudnn", 1.0, status="error: boom")  # a failed peer row is not counted
    row("h8x1-fp8-q4k", "hpcops-fp8q", 50.0 / 1.4, sm_mhz=1980.0)
    # our bf16 timed in the fp8 case: 1.3x there, at a power-capped clock (1.3 x 1584 / 1980 = 1.04x in cycles)
    row("h8x1-fp8-q4k", "hpcops-bf16kv", 50.0 / 1.4 * 1.3, sm_mhz=1584.0)
    row("h8x1-fp8-q4k", "hpcops-fp8q-queue", 50.0 / 1.4 * 1.3 / 1.2)  # a variant against the in-case bf16: 1.2x
    row("h64x8-fp8-q4k", "hpcops-fp8q-prefetch", 75.0)  # an opt-in variant: 1.333x our bf16
    row("h64x8-fp8-q4k", "hpcops-fp8q-tl", 160.0)
    return _write_report(tmp_path, "prefill", dict(gpu="G", gemm_tflops_bf16=800.0), rows)


def test_prefill_targets_ratios_and_flags(tmp_path):
    pt = _prefill_targets()
    machine, cases = pt.load(_prefill_report(tmp_path))
    bf16 = pt.bf16_markdown(cases)
    assert "| h64x8-bf16-q4k | 100.0 | 500 | flashinfer | 110.0 | 1.100 | >= 0.9 | pass |" in bf16
    assert "| h64x8-bf16-q4k | 100.0 | 500 | sdpa-cudnn | 80.0 | 0.800 | >= 0.85 | **short** |" in bf16
    assert "| h8x1-bf16-q4k | 50.0 |  | sdpa-cudnn | — | — | >= 0.85 | peer did not run |" in bf16
    assert "| h64x8-bf16-q8k | — | | | | — | | not run |" in bf16  # absent: named, not passed
    fp8 = pt.fp8_markdown(machine, cases)
    # 1.25x: short, the fp8q row must reach 100 / 1.3 µs, i.e. 5e10 FLOP in 76.9 µs = 650 TFLOP/s
    assert ("| h64x8 q4k | 100.0 | bf16 case | 500 | 80.0 | 625 | 1.250 | >= 1.3 | **short** | 76.9 | 650 |  "
            "|  |  |") in fp8  # no clocks sampled: the last two cells empty
    # h8/1 q4k has its in-case bf16 row: the goal's ratio is to it (1.3x), the bf16 case's 1.4x beside it, and the
    # ratio at equal clocks (its bf16 ran at 1584 MHz, the fp8q row at 1980)
    assert ("| h8x1 q4k | 46.4 | in case |  | 35.7 |  | 1.300 | >= 1.3 | pass |  |  | 1.400 (bf16 case) | "
            "1584 / 1980 | 1.040 |") in fp8
    assert "| h8x1 q8k | — | | | — | | — | >= 1.3 | not run | | | | | |" in fp8
    assert "800.0 TFLOP/s" in fp8
    var = pt.variants_markdown(cases)
    assert "| h64x8 q4k | hpcops-fp8q-prefetch | 75.0 | 1.333 | pass | 1.067 |" in var
    assert "| h64x8 q4k | hpcops-fp8q-tl | 160.0 | 0.625 | **short** | 0.500 |" in var
    assert "| h8x1 q4k | hpcops-fp8q-queue | 38.7 | 1.200 | **short** | 0.923 |" in var  # the in-case bf16 row
    assert pt.variants_markdown({}) == ""


def test_prefill_targets_rejects_other_reports(tmp_path):
    bad = tmp_path / "decode.json"
    bad.write_text(json.dumps(dict(suite="decode", machine={}, rows=[])))
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "prefill_targets.py"), str(bad)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "not a prefill bench report" in res.stderr
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "prefill_targets.py"), str(_prefill_report(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "# Issue 12 prefill targets (G," in res.stdout


def _read_floor():
    return _script("decode_read_floor")


def test_read_floor_counts_every_used_page_of_k_and_v():
    from hpcops.bench.suites.decode import make_decode_inputs

    mod = _read_floor()
    x = make_decode_inputs([100, 64, 1], 8, 2, False, seed=0, device="cpu", page=16, head_dim=64)
    assert mod.kv_bytes(x) == (7 + 4 + 1) * 16 * 2 * 2 * 64 * 2  # pages · page · kv heads · K and V · D · bf16
    x8 = make_decode_inputs([100], 8, 1, True, seed=0, device="cpu", page=16, head_dim=64)
    assert mod.kv_bytes(x8) == 7 * 16 * 1 * 2 * 64  # fp8: a byte a value


def test_read_floor_fixed_cost_and_report():
    mod = _read_floor()
    floors, peers = [5.0, 40.0], [15.0, 50.0]
    c = mod.fixed_cost_for(1.3, floors, peers)
    assert c > 0 and abs(mod.geomean([p / (f + c) for f, p in zip(floors, peers)]) - 1.3) < 1e-6
    assert mod.fixed_cost_for(10.0, floors, peers) == 0.0  # out of reach even at the floor
    rows = [dict(case="a h8/1 bf16", kv_bytes=5_000_000, floor_us=5.0, floor_grid="4/SM",
                 us={"hpcops": 8.0, "flashinfer-tc": 15.0, "flashinfer-decode": 20.0}),
            dict(case="b h8/1 fp8", kv_bytes=40_000_000, floor_us=40.0, floor_grid="flat",
                 us={"hpcops": 60.0, "hpcops-fp8q": 45.0, "flashinfer-tc": None, "flashinfer-decode": 50.0})]
    text = mod.report(rows, 1.3, "G")
    assert "| a h8/1 bf16 | 5.0 | 5.0 | 4/SM | hpcops | 8.0 | 3.0 | flashinfer-tc | 15.0 | 1.875 | 3.000 |" in text
    assert "| b h8/1 fp8 | 40.0 | 40.0 | flat | hpcops-fp8q | 45.0 | 5.0 | flashinfer-decode | 50.0 | 1.111 |" in text
    assert f"ratio **{math.sqrt(15 / 8 * 50 / 45):.3f}**" in text and f"+ {c:.2f} µs reaches 1.3" in text
    assert "3.0–5.0 µs over its floor" in text
    assert "out of reach" in mod.report(rows, 10.0, "G")


def test_read_floor_kernel_reads_every_value(device):
    """probe_read_floor's kernel (the floor's reader) sums all it reads, on any grid (interpreter on a CPU)."""
    import torch

    sys.path.insert(0, SCRIPTS)
    from probe_read_floor import stream_read_kernel

    src = torch.randn(5000, device=device)
    for programs in (1, 3, 8):
        out = torch.full((programs,), float("nan"), device=device)
        stream_read_kernel[(programs,)](src, out, src.numel(), BLOCK=256)
        assert abs(out.double().sum().item() - src.double().sum().item()) < 1e-3
    from probe_read_floor import check_read_all

    check_read_all(src, out, "the last grid")
    with pytest.raises(RuntimeError, match="over a short read"):
        check_read_all(src, out[:1], "a short read")


def test_read_floor_selection_and_gpu_check_stage():
    """decode_read_floor.py names the cases when --only matches none (before it asks for a GPU), picks the six h8/1
    bf16 rows by default; gpu_check.sh runs it as its floor:decode stage."""
    mod = _read_floor()
    assert [c.name for c in mod.selected_cases("h8/1 bf16")] == [
        f"{s} h8/1 bf16" for s in ("64x0.5K", "64x4K", "32x0.125K+32x4K", "2x32K+30x4K", "1x64K+15x4K", "1x128K+31x4K")]
    res = subprocess.run([sys.executable, os.path.join(SCRIPTS, "decode_read_floor.py"), "--out", "/tmp/x", "--only",
                          "nope"], capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode != 0 and "no `hpcops bench decode` case matches --only 'nope'" in res.stderr
    with open(os.path.join(SCRIPTS, "gpu_check.sh")) as f:
        sh = f.read()
    assert "    floor:decode)" in sh and "scripts/decode_read_floor.py" in sh


SHIM_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$SHIM_LOG"
case "$*" in *gpu_tests_report.py*) echo "summary: stub";; esac
exit 0
"""


@pytest.mark.parametrize("builds", [False, True], ids=["default", "GPU_TIER_BUILDS=1"])
def test_gpu_check_tier_leaves_the_cpu_only_builds_to_ci(tmp_path, builds):
    """gpu_check.sh's `tests` stage (python3 and nvidia-smi stubbed) starts pytest on every test file but the CPU-only
    builds (*_compile.py, test_measured_kernels.py), which gpu_tests.txt names as left to the CPU tier; with
    GPU_TIER_BUILDS=1, on every file."""
    import glob
    import tarfile

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python3").write_text(SHIM_PYTHON)
    (shim / "nvidia-smi").write_text("#!/usr/bin/env bash\necho stub\n")
    for f in shim.iterdir():
        f.chmod(0o755)
    log, out = tmp_path / "calls.log", tmp_path / "out"
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "SHIM_LOG": str(log), "OUT": str(out),
           "GPU_TIER_BUILDS": "1" if builds else "0"}
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_check.sh"), "tests"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = {os.path.basename(w) for line in log.read_text().splitlines() if "-m pytest" in line
           for w in line.split() if w.startswith("tests/test_")}
    every = {os.path.basename(f) for f in glob.glob(os.path.join(SCRIPTS, "..", "tests", "test_*.py"))}
    cpu_only = {f for f in every if f.endswith("_compile.py") or f == "test_measured_kernels.py"}
    assert cpu_only and "test_decode_compile.py" in cpu_only
    assert ran == (every if builds else every - cpu_only)
    with tarfile.open(out / "results.tar.gz") as t:
        report = t.extractfile("results/gpu_tests.txt").read().decode()
    assert ("left to the CPU tier" in report) != builds
    if not builds:
        assert all(f in report for f in cpu_only)


def test_ncu_sass_summary_finds_the_softmax_loop_and_sums_its_stalls(tmp_path):
    """ncu_sass_summary.py on a made-up SASS page: the loop closed by a backward branch around 60 MUFU.EX2 is found
    (the outer loop around it is not listed), its samples are summed by opcode (predicate and modifiers dropped) and
    by reason, and a file with no SASS table is a clear error."""
    import csv
    import gzip

    mod = _script("ncu_sass_summary")
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
            "stall_barrier", "stall_wait (Not Issued)"]
    base = 0x7F0000001000
    prog = ["MOV R1, R2", "LOOP_TOP: FFMA R3, R4, R5, R6"] + ["MUFU.EX2 R7, R8"] * 60 + [
        "@!P0 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80", "@P1 BRA 0x10", "IADD3 R1, R1, 1, RZ", "@P2 BRA 0x0", "EXIT"]
    rows = []
    for i, src in enumerate(prog):
        src = src.replace("LOOP_TOP: ", "")
        wait = 2 if src.startswith("MUFU") else 0
        bar = 5 if "BAR" in src else 0
        rows.append([f"{base + 16 * i:#x}", src, str(wait + bar), "10", str(wait), str(bar), "0"])
    path = tmp_path / "sass.csv.gz"
    with gzip.open(path, "wt", newline="") as f:
        f.write("==PROF== some report text above the table\n")
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(cols)
        w.writerows(rows)
    loops = mod.softmax_loops(mod.read_rows(str(path)), 60)
    assert loops == [(1, 63)], loops  # FFMA .. the inner BRA (to offset 0x10), not the outer loop from 0x0
    text = mod.report(str(path))
    assert "loop 0x7f0000001010..0x7f00000013f0: 63 instructions, 125 samples (100.0 %), 630 executed" in text
    assert "by opcode: MUFU 120, BAR 5" in text and "by reason: wait 120, barrier 5" in text
    assert mod.opcode("@!P3 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80") == "BAR"
    (tmp_path / "empty.csv").write_text("no table here\n")
    with pytest.raises(ValueError, match="no SASS source table"):
        mod.read_rows(str(tmp_path / "empty.csv"))


def test_sass_loops_lists_a_cuobjdump_listings_softmax_loop():
    """sass_loops.py on a made-up cuobjdump listing: the innermost loop around 60 MUFU.EX2 is listed (not the outer
    one, not a loop without exp2), its opcodes counted with predicates and modifiers dropped and, in order, their
    repeats collapsed."""
    mod = _script("sass_loops")
    prog = ["MOV R1, R2", "FFMA R3, R4, R5, R6"] + ["MUFU.EX2 R7, R8"] * 60 + [
        "@!P0 BAR.SYNC.DEFER_BLOCKING 0x2, 0x80", "@P1 BRA 0x10", "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [UR4], RZ",
        "@!P2 BRA 0x3f0", "@P2 BRA 0x0", "EXIT"]
    listing = "\n".join(f"        /*{16 * i:04x}*/                   {src} ;  /* 0x000fe20000000f00 */"
                        for i, src in enumerate(prog))
    assert mod.loop_lines(listing, 60, seq=True) == [
        "loop 0x0010-0x03f0: 63 instructions",
        "  MUFU 60, FFMA 1, BAR 1, BRA 1",
        "  FFMA x1 | MUFU x60 | BAR x1 | BRA x1",
    ]
    assert mod.loop_lines(listing, 61, seq=False) == []
