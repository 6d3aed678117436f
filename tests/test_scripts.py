"""The GPU-run plumbing that can be checked without a GPU: the test-tier report and the smoke stage."""

from __future__ import annotations

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
    """Every GPU script in scripts/ has a smallest run in gpu_check.sh's `smoke` stage."""
    with open(os.path.join(SCRIPTS, "gpu_check.sh")) as f:
        sh = f.read()
    smoke = sh[sh.index("    smoke)"):]
    smoke = smoke[:smoke.index(";;")]
    from hpcops.bench.tune import OPS

    swept = set(re.search(r"for s in ([a-z ]+); do", smoke).group(1).split())
    sweeps = {f[len("sweep_"):-3] for f in os.listdir(SCRIPTS) if f.startswith("sweep_")}
    assert swept == sweeps | set(OPS)
    assert 'python3 -m hpcops tune "$s" --smoke' in smoke
    assert "profile_decode.py" in smoke


@pytest.mark.parametrize("op", ["moe"])
def test_tune_has_a_smoke_run(op, capsys):
    """`hpcops tune OP --smoke` narrows the tune (listed with --dry-run, no GPU needed)."""
    from hpcops.cli import main

    assert main(["tune", op, "--dry-run"]) == 0
    full = capsys.readouterr().out
    assert main(["tune", op, "--dry-run", "--smoke"]) == 0
    smoke = capsys.readouterr().out
    assert 0 < len(smoke.splitlines()) < len(full.splitlines())
    assert "2 phase-A candidates" in smoke


@pytest.mark.parametrize("script", ["sweep_decode.py", "sweep_rope.py", "sweep_prefill.py"])
def test_sweeps_have_a_smoke_run(script):
    """`--smoke` exists and narrows the sweep (listed with --dry-run, no GPU needed)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    full = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=300)
    smoke = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), "--dry-run", "--smoke"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert full.returncode == 0 and smoke.returncode == 0, full.stderr[-2000:] + smoke.stderr[-2000:]
    assert 0 < len(smoke.stdout.splitlines()) < len(full.stdout.splitlines())
