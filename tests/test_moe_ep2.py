"""Expert parallelism across real ranks (scripts/moe_ep2.py): ranks run fused_moe on their own experts and
all-reduce the outputs, which must equal the single-device result.

CPU tier: two gloo ranks on the CPU, kernels through Triton's interpreter, tiny shapes (E 8, k 2, H 128,
I 128), every quantization; and the check must fail when a rank is wrong (a shifted expert_map, the shared
output added on every rank). GPU tier: two NCCL ranks, one per GPU, at Hy3 shapes with CUDA-graph replay,
where two GPUs exist (the nvidia-h200-x2 machine).

The script runs in its own session (process group); after it the group must be empty, so no rank (and no
rank's listening port) outlives a test, and a run past its time limit is killed as a group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import HAS_CUDA, load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "moe_ep2.py")


ep2 = load_script("moe_ep2", "moe_ep2_script")


def _live_in_group(pgid: int) -> list[int]:
    """Processes of process group `pgid` that still run (zombies, dead and waiting for init to reap them, hold
    no port or memory and are not counted)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    live = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            live.append(int(d))
    return live


def run_script(tmp_path, *args: str, timeout: float) -> tuple[int, str, dict]:
    """Run the script in a new session; returns (exit code, output, moe_ep2.json). Fails the test if any
    process of the session is left after it."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    if "gloo" not in args:
        env.pop("TRITON_INTERPRET", None)  # NCCL ranks run the compiled kernels
    proc = subprocess.Popen([sys.executable, SCRIPT, "--out", str(tmp_path), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"moe_ep2.py {' '.join(args)} ran past {timeout} s (killed):\n{out[-4000:]}")
    # multiprocessing's resource tracker exits once the script has (it reads the script's pipe): a moment
    deadline = time.monotonic() + 10
    while _live_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _live_in_group(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"moe_ep2.py left processes {left} behind (killed)")
    path = tmp_path / "moe_ep2.json"
    rep = json.loads(path.read_text()) if path.exists() else {}
    return proc.returncode, out, rep


# ---- the script's pieces, in process -----------------------------------------------------------------------


@pytest.mark.parametrize("placement", ep2.PLACEMENTS)
def test_owners_partition_the_experts(placement):
    own = ep2.owners(12, 2, placement, seed=0)
    assert sorted(own[0] + own[1]) == list(range(12)) and len(own[0]) == len(own[1]) == 6
    if placement == "round_robin":
        assert own == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]
    m = ep2.expert_map(12, own[1], "cpu")
    assert [int(m[e]) for e in own[1]] == list(range(6)) and all(int(m[e]) == -1 for e in own[0])


@pytest.mark.parametrize("t", [torch.rand(6), torch.randn(6, 3, 4).to(torch.float8_e4m3fn),
                               torch.randn(6, 5).bfloat16(), torch.rand(6, 2, 3)], ids=["1d", "fp8", "bf16", "3d"])
def test_take_selects_local_rows(t):
    """The local experts' rows of weights and per-expert scales (1-D scales included), any dtype."""
    sel = torch.tensor([4, 1, 3])
    got = ep2.take(t, sel)
    assert got.dtype == t.dtype and got.is_contiguous() and torch.equal(got.float(), t.float()[sel])


def test_routing_has_tokens_with_only_remote_experts():
    """Token t % 3 == 1 routes only to the last rank's experts, t % 3 == 2 only to rank 0's."""
    own = ep2.owners(8, 2, "shuffled", seed=0)
    tw, ids = ep2.routing(7, 2, 8, own, "cpu", seed=1)
    assert ids.dtype == torch.int32 and tw.dtype == torch.float32
    for t in range(7):
        row = set(ids[t].tolist())
        assert len(row) == 2
        if t % 3 == 1:
            assert row <= set(own[1])
        if t % 3 == 2:
            assert row <= set(own[0])
    torch.testing.assert_close(tw.sum(-1), torch.full((7,), ep2.ROUTED_SCALE))


def test_bound_is_two_bf16_roundings():
    """compare_single passes the sum of bf16-rounded partials against the bf16-rounded total, and fails an
    error a few bf16 roundings past it."""
    g = torch.Generator().manual_seed(0)
    p0, p1 = torch.randn(64, 32, generator=g), torch.randn(64, 32, generator=g)
    s = (p0 + p1).bfloat16()
    a = p0.bfloat16().float() + p1.bfloat16().float()
    pabs = p0.bfloat16().float().abs() + p1.bfloat16().float().abs()
    got = ep2.compare_single(a, pabs, s)
    assert got["ok"] and got["bound_use"] <= 1.0, got
    bad = a.clone()
    bad[3, 5] += 4 * ep2.U_BF16 * float(s[3, 5].float().abs() + pabs[3, 5])
    assert not ep2.compare_single(bad, pabs, s)["ok"]
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert not ep2.compare_single(nan, pabs, s)["ok"]


# ---- two gloo ranks on the CPU -----------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier: the gloo ranks run the kernels through the interpreter (numpy < 2.4); "
                    "the GPU tier runs the NCCL check (test_gpu_ep2_nccl)")
def test_ep2_gloo_cpu(tmp_path):
    """Two CPU ranks, every quantization, batches 1/5/12, round-robin, contiguous and shuffled experts."""
    rc, out, rep = run_script(tmp_path, "--backend", "gloo", "--world", "2", timeout=240)
    assert rc == 0, out[-4000:]
    assert rep["complete"] and rep["passed"] and rep["world"] == 2 and rep["backend"] == "gloo"
    cases = rep["cases"]
    assert {c["quant"] for c in cases} == set(ep2.QUANTS)
    assert {c["placement"] for c in cases} == set(ep2.PLACEMENTS)
    for c in cases:
        assert c["passed"] and c["vs_single"]["bound_use"] <= 1.0 and c["graph"] is None, c
    assert (tmp_path / "moe_ep2.md").read_text().count("| pass |") == len(cases)


@pytest.mark.skipif(HAS_CUDA, reason="CPU tier: the gloo ranks run the kernels through the interpreter (numpy < 2.4); "
                    "the GPU tier runs the NCCL check (test_gpu_ep2_nccl)")
@pytest.mark.parametrize("fault", ["wrong_map", "shared_everywhere"])
def test_ep2_gloo_catches_a_wrong_rank(tmp_path, fault):
    """A rank with a shifted expert_map, or the shared output added on both ranks: every case fails its
    comparison with the single-device result and the script exits 1."""
    rc, out, rep = run_script(tmp_path, "--backend", "gloo", "--quick", "--quants", "bf16,fp8_static",
                              "--fault", fault, timeout=180)
    assert rc == 1, out[-4000:]
    assert rep["complete"] and not rep["passed"] and rep["fault"] == fault
    for c in rep["cases"]:
        assert not c["passed"] and "vs_single" in c["failed_checks"], c
        assert c["vs_single"]["bound_use"] > 10
    assert "**FAIL**" in (tmp_path / "moe_ep2.md").read_text()


# ---- two GPUs over NCCL ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_ep2_nccl(tmp_path):
    """Two NCCL ranks (cuda:0, cuda:1), Hy3 experts (E 192, k 8, H 4096, I 1536), every quantization at
    B 1 and 64, with CUDA-graph capture and replay of each rank's EP call."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 CUDA GPUs for NCCL expert parallelism, found {n} (the nvidia-h200-x2 machine: "
                    "python3 scripts/moe_ep2.py --out DIR)")
    rc, out, rep = run_script(tmp_path, "--backend", "nccl", "--world", "2", "--quick", timeout=400)
    assert rc == 0, out[-4000:]
    assert rep["complete"] and rep["passed"] and len(rep["devices"]) == 2
    for c in rep["cases"]:
        assert c["graph"] is not None and c["graph"]["ok"], c
