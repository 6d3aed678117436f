"""What a new user meets first: the `hpcops` command (usage errors instead of tracebacks), the demo's
text, the README's commands, and the packaging (LICENSE, pyproject, set-up progress lines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcops.attention.plan import DEFAULT_MIN_TILES, DEFAULT_PROGRAMS_PER_SM, DEFAULT_TASK_COST, MAX_Q_LEN
from hpcops.bench.scenarios import MAX_KV_LEN, MAX_REQUESTS, parse_lengths
from hpcops.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _usage_error(capsys, argv: list[str]) -> str:
    """Run the CLI, expect argparse's usage error (exit 2, no traceback); return its error line."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    return lines[0]


# --- hpcops plan: the length spec ---------------------------------------------------------------

@pytest.mark.parametrize("spec", ["abc", "", "1x-5", "1x4M", "1,,2", "   ", "1x4K+", "x4K"])
def test_plan_malformed_spec_is_a_usage_error(capsys, spec):
    line = _usage_error(capsys, ["plan", spec])
    assert line.startswith("hpcops plan: error: argument lengths:")
    assert "1x128K+31x4K" in line  # says what a good spec looks like


def test_plan_too_many_requests_states_the_limit(capsys):
    line = _usage_error(capsys, ["plan", "99999999999x1"])  # was a MemoryError
    assert f"at most {MAX_REQUESTS}" in line


def test_plan_too_long_a_request_states_the_limit(capsys):
    line = _usage_error(capsys, ["plan", f"1x{MAX_KV_LEN + 1}"])
    assert f"at most {MAX_KV_LEN}" in line


def test_plan_total_tiles_beyond_int32_is_a_usage_error(capsys):
    # 16384 requests of 16M tokens over 128 kv heads: 2^39 tiles (printed as a negative count before)
    line = _usage_error(capsys, ["plan", f"{MAX_REQUESTS}x{MAX_KV_LEN}", "--num-kv-heads", "128"])
    assert line.startswith("hpcops plan: error:") and "tiles" in line and "at most" in line


def test_parse_lengths_limits_and_valid_input():
    assert parse_lengths(f"{MAX_REQUESTS}x{MAX_KV_LEN // 1024}K") == [MAX_KV_LEN] * MAX_REQUESTS
    assert parse_lengths("0x4K") == [] and parse_lengths("0,5") == [0, 5]
    assert parse_lengths("1x0.3K") == [307]
    for spec in ("99999999999x1", f"{MAX_REQUESTS}x1+1x1", f"1x{MAX_KV_LEN + 1}", "1x" + "9" * 400, ""):
        with pytest.raises(ValueError):
            parse_lengths(spec)


def test_plan_help_states_limits_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert str(MAX_REQUESTS) in text and f"{MAX_KV_LEN // 1024}K" in text
    assert f"{DEFAULT_PROGRAMS_PER_SM} per SM" in text and "4 x SMs" not in text
    for option, default in (("--num-kv-heads", 1), ("--q-len", 1), ("--block-size", 64),
                            ("--min-tiles", DEFAULT_MIN_TILES), ("--task-cost", DEFAULT_TASK_COST)):
        m = re.search(re.escape(option) + r" \S+ (.*?)(?= --|$)", text.split("options:")[1])
        assert m and f"(default: {default})" in m.group(1), (option, text)
    assert f"1..{MAX_Q_LEN}" in text


# --- hpcops plan: options -----------------------------------------------------------------------

@pytest.mark.parametrize("argv,option,allowed", [
    (["--num-programs", "-5"], "--num-programs", "1.."),   # was a torch-internal RuntimeError
    (["--num-programs", "0"], "--num-programs", "1.."),    # was silently 264
    (["--num-programs", "many"], "--num-programs", "1.."),
    (["--min-tiles", "0"], "--min-tiles", "1.."),          # was silently clamped to 1
    (["--min-tiles", "-3"], "--min-tiles", "1.."),
    (["--task-cost", "-1"], "--task-cost", "0.."),
    (["--q-len", "0"], "--q-len", f"1..{MAX_Q_LEN}"),
    (["--q-len", str(MAX_Q_LEN + 1)], "--q-len", f"1..{MAX_Q_LEN}"),
    (["--num-kv-heads", "0"], "--num-kv-heads", "1.."),
    (["--block-size", "48"], "--block-size", "256"),
    (["--block-size", "512"], "--block-size", "256"),
])
def test_plan_bad_option_is_a_usage_error(capsys, argv, option, allowed):
    line = _usage_error(capsys, ["plan", "4x4K", *argv])
    assert line.startswith(f"hpcops plan: error: argument {option}")
    assert allowed in line


def test_plan_prints_the_readme_example(capsys):
    assert main(["plan", "1x128K+31x4K", "--num-kv-heads", "8", "--block-size", "16", "--q-len", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("32 requests, 258048 KV tokens, 8 kv heads")


def test_plan_honours_num_programs_and_min_tiles(capsys):
    assert main(["plan", "5,6,700", "--num-programs", "3", "--min-tiles", "1", "--task-cost", "0"]) == 0
    assert "3 programs, bucket 5 tiles" in capsys.readouterr().out
    # 13 tiles + 3 task starts of 3/4 tile: 61 quarters over 3 programs: buckets of 21 quarters
    # (with splits: --split-cost 0); the default split cost (8 tiles) keeps the 11-tile request whole instead
    assert main(["plan", "5,6,700", "--num-programs", "3", "--min-tiles", "1", "--task-cost", "3",
                 "--split-cost", "0"]) == 0
    assert "3 programs, bucket 5.25 tiles of cost (a task costs 0.75), 3 active" in capsys.readouterr().out
    assert main(["plan", "5,6,700", "--num-programs", "3", "--min-tiles", "1", "--task-cost", "3"]) == 0
    out = capsys.readouterr().out
    assert "bucket 11.75 tiles of cost" in out and "0 split pieces (whole requests" in out


# --- hpcops demo / bench ------------------------------------------------------------------------

def test_demo_png_into_a_missing_folder_fails_first(capsys):
    line = _usage_error(capsys, ["demo", "--no-check", "--png", "/nonexistent/x.png"])
    assert line.startswith("hpcops demo: error: argument --png:") and "/nonexistent" in line


def test_demo_png_naming_a_folder_fails_first(capsys, tmp_path):
    line = _usage_error(capsys, ["demo", "--no-check", "--png", str(tmp_path)])
    assert "folder" in line


def test_demo_png_is_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "load.png"
    assert main(["demo", "--no-check", "--png", str(path)]) == 0
    assert path.stat().st_size > 0 and f"wrote {path}" in capsys.readouterr().out


def test_bench_unknown_suite_returns_2(capsys):
    assert main(["bench", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


def _demo_text(capsys) -> str:
    from hpcops.demo import run_demo

    assert run_demo(check=False) == 0
    return capsys.readouterr().out


def test_demo_bar_frames_have_one_width(capsys):
    frames = [ln for ln in _demo_text(capsys).splitlines() if ln.count("|") == 2]
    assert len(frames) == 12  # six scenarios, static and dynamic
    assert len({ln.index("|") for ln in frames}) == 1
    assert len({ln.rindex("|") for ln in frames}) == 1


def test_sparkline_width_and_visible_small_loads():
    from hpcops.demo import BARS, sparkline

    for n in (1, 5, 63, 64, 65, 264, 320, 1000):
        assert len(sparkline([1] * n)) == 64
    line = sparkline([1000] + [1] * 63 + [0] * 64, width=128)
    assert line[0] == BARS[-1]
    assert set(line[1:64]) == {BARS[1]}  # busy, however little: the lowest bar, not blank
    assert set(line[64:]) == {" "}      # idle: blank
    assert sparkline([0, 5], width=2, top=10) == " " + BARS[4]


def test_demo_explains_its_terms_and_numbers(capsys):
    text = _demo_text(capsys)
    flat = " ".join(text.split())
    for term in ("h8/1", "Hy3", "Hunyuan", "program ", "slot "):
        assert term in text.split("Every KV sequence")[0], term  # in the legend, before the table
    # 64x4K: static max 13 per program vs busiest slot 26: 320 programs on 264 slots
    assert "64x4K: the static grid has 320 programs of ≤ 13 tiles for 264 slots, so 56 slots run two" in flat
    # 64x0.5K: the plan's whole cut (one request a program) is explained by the split cost, with its numbers
    assert "64x0.5K: short uniform requests. The plan keeps each one whole (64 programs of 8 tiles, 200 idle)" in flat
    assert "charges as 10 tiles on the busiest SM (DecodeConfig.split_cost)" in flat and "reads 0.25x against" in flat


def test_demo_correctness_line_names_its_dtypes(capsys):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the demo's check runs kernels: needs TRITON_INTERPRET=1 on a CPU")
    from hpcops.demo import run_demo

    assert run_demo(check=True) == 0
    out = " ".join(capsys.readouterr().out.split())
    line = out[out.index("correctness:"):]
    for part in ("q fp16", "KV cache fp16", "out fp16", "fp16 tolerance", "GQA 4", "pages of 16"):
        assert part in line, part


@pytest.mark.parametrize("argv", [["plan", "1x128K+31x4K", "--num-kv-heads", "8"], ["demo", "--no-check"]])
def test_output_into_a_closed_pipe_is_no_traceback(argv):
    """`hpcops plan ... | head`: the reader closes the pipe; the command stops without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcops", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the command writes anything: its first write fails
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err

def test_cli_import_leaves_triton_unloaded():
    """`hpcops demo|plan` must set TRITON_INTERPRET before Triton loads; importing the CLI must not load it."""
    code = "import sys, hpcops.cli; sys.exit('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env).returncode == 0


# --- README, packaging, set-up ------------------------------------------------------------------

def test_readme_opens_with_setup_and_tests_and_its_commands_use_the_venv():
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].startswith("bash scripts/setup.sh && .venv/bin/hpcops demo")
    assert block[1].startswith("bash scripts/test.sh")
    # every demo/plan command is the one the set-up installed (a bare `hpcops` is not on PATH)
    cmds = re.findall(r"`([^`|\n]*\bhpcops (?:demo|plan)\b[^`|\n]*)`", text.split("```", 2)[2])
    assert len(cmds) >= 2
    for cmd in cmds:
        assert cmd.startswith(".venv/bin/hpcops "), cmd
    if not (ROOT / ".venv" / "bin" / "hpcops").exists():
        pytest.skip("no .venv/bin/hpcops here (scripts/setup.sh makes it)")
    for cmd in cmds:
        if " plan " in cmd:  # runs as written (the demo's check is covered above)
            res = subprocess.run(cmd.split(), cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert res.returncode == 0 and "Traceback" not in res.stderr, (cmd, res.stderr)


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190


def test_pyproject_license_is_an_spdx_string():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert meta["project"]["license-files"] == ["LICENSE"]
    req = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert req == ["setuptools>=77"]  # SPDX license strings need setuptools 77


def test_pyproject_vllm_extra_is_the_supported_range():
    """`pip install hpcops[vllm]` asks for exactly the vLLM versions the plugin's version gate accepts."""
    tomllib = pytest.importorskip("tomllib")
    from hpcops.integrations.vllm._version import SUPPORTED_RANGE

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["optional-dependencies"]["vllm"] == [f"vllm{SUPPORTED_RANGE}"]


def _fake_setup(tmp_path: Path, fail: str = "") -> subprocess.CompletedProcess:
    """Run scripts/setup.sh in a copy whose .venv/bin/python is a stub: pip prints noise, installs nothing."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((ROOT / "scripts" / "setup.sh").read_text())
    stub = tmp_path / ".venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/usr/bin/env bash\n"
                    "if [ \"$1\" = - ]; then cat >/dev/null; exit 1; fi\n"          # the pin check: reinstall
                    "case \"$*\" in *'import vllm'*) exit 1;; esac\n"                # vLLM absent: install it
                    "echo \"pip noise: $*\"; echo 'pip warning' >&2\n"
                    f"case \"$*\" in *'{fail or '@never@'}'*) exit 3;; esac\n")
    stub.chmod(0o755)
    return subprocess.run(["bash", str(tmp_path / "scripts" / "setup.sh")], capture_output=True, text=True,
                          timeout=60)


def test_setup_prints_one_line_per_step_and_keeps_pip_quiet(tmp_path):
    res = _fake_setup(tmp_path)
    assert res.returncode == 0, res.stderr
    steps = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    n = len(steps)
    assert [ln.split("]")[0] for ln in steps] == [f"[{i}/{n}" for i in range(1, n + 1)]
    assert any("torch 2.13.0" in ln for ln in steps) and any("vLLM" in ln for ln in steps)
    assert "pip" not in res.stderr and "pip noise" not in res.stdout


def test_setup_shows_pip_output_when_a_step_fails(tmp_path):
    res = _fake_setup(tmp_path, fail="torch==2.13.0")
    assert res.returncode != 0
    assert "pip noise" in res.stderr and "torch==2.13.0" in res.stderr
    assert "[3/" in res.stdout and "[4/" not in res.stdout
