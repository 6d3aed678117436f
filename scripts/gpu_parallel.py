"""Run `scripts/gpu_check.sh` stages on several GPUs of one machine at once, in one device call.

    python3 scripts/gpu_parallel.py "tests" "bench:decode ; bench:router ; BENCH_ARGS=--quick bench:layer"
    python3 scripts/gpu_parallel.py --limit 560 "timeout=300 BENCH_ARGS='--only bf16' bench:prefill" \
        "BENCH_ARGS='--only fp8' bench:prefill"

Each argument is one GPU's queue (GPU i = the i-th argument, CUDA_VISIBLE_DEVICES=i): jobs separated by `;`,
run in order. A job is a gpu_check.sh stage, optionally preceded by `timeout=SECONDS` and by environment
assignments for that job alone (BENCH_ARGS, TUNE_ARGS, TEST_TIMEOUT, PROFILE_ARGS, ...; shell quoting).
Every job writes into its own folder `$OUT/<gpu>-<n>-<stage>` (gpu_check.sh's gpu.txt, logs, results). A job
that overruns its timeout, or the queue's share of `--limit` (seconds for the whole call, default 570: under
the device tool's 600), is stopped; what it wrote so far is kept (the suites rewrite their reports after every
case, the tuner after every scenario).

At the end `$OUT` holds three files, whatever happened: `all.tgz` (every job's folder, with its
`results.tar.gz` unpacked into `results/`), `summary.txt` (per job: status, seconds, the log's last lines) and
`summary.json`. The device tool returns at most 8 files from `$OUT`, so the job folders are removed once packed.
Unpack here with `tar xzf all.tgz -C <dir>`; `python -m hpcops.bench.report <suite> OUT A/results B/results`
joins the parts of a suite split over jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Job:
    gpu: int
    index: int
    stage: str
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    status: str = "pending"  # ok | failed (rc N) | timeout | skipped: no time left
    seconds: float = 0.0
    tail: str = ""

    @property
    def folder(self) -> str:
        return f"gpu{self.gpu}-{self.index}-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", self.stage)


def _split_jobs(spec: str) -> list[list[str]]:
    """The queue's jobs as shell words: `;` separates jobs only outside quotes (PROFILE_ARGS may hold one)."""
    lex = shlex.shlex(spec, posix=True, punctuation_chars=";")
    lex.whitespace_split = True
    jobs: list[list[str]] = [[]]
    for tok in lex:
        if tok and set(tok) == {";"}:
            jobs.append([])
        else:
            jobs[-1].append(tok)
    return [words for words in jobs if words]


def parse_queue(gpu: int, spec: str) -> list[Job]:
    """One GPU's queue: `[timeout=S] [VAR=value ...] stage ; ...` (shell quoting inside a job; a quoted `;` stays
    in its word)."""
    jobs = []
    for n, words in enumerate(_split_jobs(spec)):
        part = " ".join(words)
        job = Job(gpu, n, "")
        for w in words:
            key, eq, value = w.partition("=")
            if job.stage:
                raise ValueError(f"GPU {gpu} job {n}: one stage a job, got {job.stage!r} and {w!r}")
            if eq and key == "timeout":
                job.timeout = float(value)
            elif eq and ENV_NAME.match(key):
                job.env[key] = value
            else:
                job.stage = w
        if not job.stage:
            raise ValueError(f"GPU {gpu} job {n}: no stage in {part.strip()!r}")
        jobs.append(job)
    return jobs


def run_queue(jobs: list[Job], out: Path, deadline: float, check: list[str]) -> None:
    for job in jobs:
        left = deadline - time.monotonic()
        if left < 5:
            job.status = "skipped: no time left"
            continue
        limit = left if job.timeout is None else min(job.timeout, left)
        folder = out / job.folder
        folder.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **job.env, "OUT": str(folder), "CUDA_VISIBLE_DEVICES": str(job.gpu)}
        log = folder / "job.log"
        t0 = time.monotonic()
        with open(log, "w") as f:
            # own process group: a timeout stops the stage and everything it started
            proc = subprocess.Popen([*check, job.stage], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                job.status = "ok" if rc == 0 else f"failed (rc {rc})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 15)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, 9)
                    proc.wait()
                job.status = f"timeout ({limit:.0f} s)"
        job.seconds = round(time.monotonic() - t0, 1)
        job.tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
        packed = folder / "results.tar.gz"
        if packed.exists():  # gpu_check.sh's archive of results/: unpack it, one archive in the end
            with tarfile.open(packed) as t:
                t.extractall(folder, filter="data")
            packed.unlink()


def pack(out: Path, jobs: list[Job]) -> None:
    summary = []
    for job in jobs:
        summary.append(f"== GPU {job.gpu} job {job.index}: {job.stage} {job.env or ''} -> {job.status}, "
                       f"{job.seconds} s\n{job.tail}\n")
    (out / "summary.txt").write_text("\n".join(summary))
    (out / "summary.json").write_text(json.dumps([asdict(j) for j in jobs], indent=1))
    folders = [out / j.folder for j in jobs if (out / j.folder).exists()]
    with tarfile.open(out / "all.tgz", "w:gz") as t:
        for f in folders:
            t.add(f, arcname=f.name)
    for f in folders:
        shutil.rmtree(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("queues", nargs="+", metavar="QUEUE", help="one GPU's jobs: '[timeout=S] [VAR=v] stage ; ...'")
    ap.add_argument("--limit", type=float, default=570.0, help="seconds for the whole call (default 570)")
    ap.add_argument("--check", default=os.environ.get("HPCOPS_GPU_CHECK", "bash scripts/gpu_check.sh"),
                    help="the stage runner (default: bash scripts/gpu_check.sh)")
    args = ap.parse_args(argv)
    try:
        queues = [parse_queue(i, q) for i, q in enumerate(args.queues)]
    except ValueError as exc:
        print(f"gpu_parallel: {exc}", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", ROOT / "out"))
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.limit
    # the runner's preamble (wheels into /tmp/site, the editable install) once, before the queues race for it
    setup = out / "setup"
    setup.mkdir(exist_ok=True)
    subprocess.run([*shlex.split(args.check), "setup"], cwd=ROOT, env={**os.environ, "OUT": str(setup)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=max(5.0, args.limit / 4))
    shutil.rmtree(setup, ignore_errors=True)
    threads = [threading.Thread(target=run_queue, args=(q, out, deadline, shlex.split(args.check))) for q in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jobs = [j for q in queues for j in q]
    pack(out, jobs)
    print((out / "summary.txt").read_text())
    return 0 if all(j.status == "ok" for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
