"""Did the kernels a benchmark measured change since? Compare their sm_90 PTX across commits, no GPU.

Runs the decode, MoE, rope, prefill and router entry points on the CPU with every Triton kernel replaced by a
recorder (the launches the default configs make for the benchmarks' cases: heads, dtypes, batch sizes; decode's
as on an H200, where an fp8 q over fp8 KV takes the Gluon kernel, compiled through Gluon's own front end;
rope, prefill and router through their bench suites' own scenarios and input builders), compiles
each recorded launch ahead of time for sm_90 (`triton.compile`, as the compile tests do) and hashes the
PTX with parameter numbering and debug info stripped (so an added, unused kernel argument does not
count as a change). With `--against REV` the same runs happen in a temporary worktree of REV and the
launch sequences are compared: same kernels in the same order with identical PTX means the figures
measured at REV stand for this tree's defaults. `--check FILE` compares with recorded fingerprints
(`bench/results/fingerprints.json`: the launches the committed H200 results measured), so a change to
a default kernel shows up in CI as "re-measure on the GPU, then re-record".

    python scripts/ptx_fingerprint.py --against bd7055a --ops decode   # decode bench's commit
    python scripts/ptx_fingerprint.py --against 9b72fb7 --ops moe      # MoE bench's commit
    python scripts/ptx_fingerprint.py --ops decode,moe,rope,prefill,router > bench/results/fingerprints.json
        # record the ops whose committed results measured this tree
    python scripts/ptx_fingerprint.py --check bench/results/fingerprints.json  # what CI runs

Exit status 1 when a launch differs. Needs no GPU; takes a few minutes (Triton compiles on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

OPS = ("decode", "moe", "rope", "prefill", "router")
# kernel modules of each op, and the modules that import kernels by name (patched too)
KERNEL_MODULES = {"decode": ("hpcops.attention._decode_kernels", "hpcops.attention._plan_kernels",
                              "hpcops.attention._decode_gluon"),
                  "moe": ("hpcops.moe._moe_kernels",),
                  "rope": ("hpcops.rope._rope_kernels", "hpcops.attention._kv_store_kernels"),
                  "prefill": ("hpcops.attention._prefill_kernels", "hpcops.attention._prefill_gluon"),
                  "router": ("hpcops.moe._moe_kernels",)}
USER_MODULES = {"decode": ("hpcops.attention.plan", "hpcops.attention.decode"), "moe": ("hpcops.moe.fused_moe",),
                "rope": ("hpcops.rope.prologue", "hpcops.attention.kv_store"), "prefill": ("hpcops.attention.prefill",),
                "router": ("hpcops.moe.routing",)}


def _launch_tools():
    """hpcops.testing of this checkout, loaded from its file: with `--against` the package on the path is
    an older tree's, which may predate the launch-recording helpers."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hpcops", "testing.py")
    spec = importlib.util.spec_from_file_location("_hpcops_launch_tools", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _as_on_sm90():
    """Within the block the Gluon device check (`decode._hopper`, which prefill's also asks) answers as on an
    sm_90 GPU, so that the CPU records the launches an H200 makes. An older tree (`--against`) may predate it."""
    from hpcops.attention import decode as dec

    hopper = getattr(dec, "_hopper", None)
    if hopper is not None:
        dec._hopper = lambda device: None
    try:
        yield
    finally:
        if hopper is not None:
            dec._hopper = hopper


def _decode_runs(label):
    """The decode bench's rows as an H200 launches them: the plan told what the call takes (`plan_kernel`: an fp8
    q over fp8 KV takes the Gluon kernel there), the device checks answered as on sm_90."""
    import hpcops
    from hpcops.bench.suites.decode import make_decode_inputs

    with _as_on_sm90():
        for hq, hkv in ((8, 1), (64, 8)):
            for fp8 in (True, False):
                x = make_decode_inputs([100, 300, 64, 1000], hq, hkv, fp8, 0, device="cpu")
                runs = [("dynamic", False), ("static", False)] + ([("dynamic", True)] if fp8 else [])
                for sched, fp8q in runs:
                    label(f"h{hq}/{hkv}-{'fp8' if fp8 else 'bf16'}-{sched}{'-fp8q' if fp8q else ''}")
                    q, qs = (x["q8"], x["q_scale"]) if fp8q else (x["q"], None)
                    plan = None
                    if sched == "dynamic":
                        hints = dict(num_q_heads=hq, head_dim=128, q_dtype=q.dtype, kv_dtype=x["k_cache"].dtype,
                                     max_seq_len=x["max_seq_len"])
                        try:
                            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=64, **hints)
                        except TypeError:  # an older tree without the hints
                            plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=64)
                    hpcops.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                            plan=plan, schedule=sched, k_scale=x["k_scale"], v_scale=x["v_scale"],
                                            q_scale=qs, out=x["out"])


def _moe_runs(label):
    import torch

    from hpcops.quant import Fp8Block128, Fp8PerTensor

    fused = importlib.import_module("hpcops.moe.fused_moe")
    fp8 = torch.float8_e4m3fn
    h, k, e_global = 4096, 8, 192
    g = torch.Generator().manual_seed(0)
    for layout, inter, n_local, batches in (("tp8", 192, 192, (4, 16, 64, 512, 2048, 4096, 16384)),
                                            ("ep8", 1536, 24, (4, 64, 512, 2048))):
        for kind in ("fp8_tensor", "none", "fp8_block"):
            if kind == "fp8_block" and inter % 128:
                continue
            wdt = torch.bfloat16 if kind == "none" else fp8
            w13 = torch.empty(n_local, 2 * inter, h, dtype=wdt)
            w2 = torch.empty(n_local, h, inter, dtype=wdt)
            one = torch.ones(1)
            quant = {"none": None,
                     "fp8_tensor": Fp8PerTensor(torch.ones(n_local), torch.ones(n_local), one, one),
                     "fp8_block": Fp8Block128(torch.ones(n_local, 2 * inter // 128, h // 128),
                                              torch.ones(n_local, h // 128, inter // 128))}[kind]
            emap = None
            if layout == "ep8":
                emap = torch.full((e_global,), -1, dtype=torch.int32)
                emap[:n_local] = torch.arange(n_local, dtype=torch.int32)
            for t in batches:
                label(f"{layout}-{kind}-B{t}")
                x = torch.empty(t, h, dtype=torch.bfloat16)
                ids = torch.stack([torch.randperm(e_global, generator=g)[:k] for _ in range(t)]).to(torch.int32)
                fused.fused_moe(x, w13, w2, torch.rand(t, k), ids, quant=quant, expert_map=emap,
                                shared_output=torch.zeros_like(x))


def _suite_runs(label, suite_name):
    """Our row of every case of a bench suite (its own scenarios and input builders, on the CPU), the device
    checks answered as on sm_90 (prefill's default takes the Gluon kernel there)."""
    suite = importlib.import_module(f"hpcops.bench.suites.{suite_name}")
    with _as_on_sm90():
        for case in suite.cases({}):
            x = case.make_inputs(0, "cpu")
            for impl in case.impls:
                if impl.ours:
                    label(f"{case.name}:{impl.name}")
                    impl.prepare(x)()


def _normalized_ptx(ptx: str) -> str:
    """The PTX without its debug sections (DWARF `.b8` / `.b32` / `.b64` data, whose `$L__tmp` label numbers move
    when a helper function is inlined elsewhere), comments, parameter declarations and names."""
    keep = []
    for line in ptx.splitlines():
        s = line.strip()
        if ".param" in s or "debug" in s or s.startswith(("//", ".file", ".loc", "$L__", ".b8", ".b32", ".b64",
                                                           ".section", ".version", ".target", "}")):
            continue
        keep.append(line)
    return re.sub(r"\w+_param_\d+", "P", "\n".join(keep))


def fingerprint(ops: list[str]) -> list[dict]:
    """[{run, kernel, constexprs, sha, instructions}] for every launch of each op's runs, in order."""
    tools = _launch_tools()
    names = dict.fromkeys(n for op in ops for n in KERNEL_MODULES[op] + USER_MODULES[op])  # moe, router share one
    modules = [importlib.import_module(n) for n in names]
    kernels = {a: v for m in modules for a, v in vars(m).items() if a.endswith("_kernel")}
    with tools.recorded_launches(*modules) as log:
        def label(run):
            log.append(("__run__", run, None))

        for op in ops:
            if op in ("rope", "prefill", "router"):
                _suite_runs(label, op)
            else:
                {"decode": _decode_runs, "moe": _moe_runs}[op](label)

    out, run, cache = [], "", {}
    for kernel, args, kw in log:
        if kernel == "__run__":
            run = args
            continue
        desc = tools.describe_launch(kernels[kernel], args, kw)
        key = json.dumps([kernel, desc], sort_keys=True, default=str)
        if key not in cache:
            body = _normalized_ptx(tools.compile_launch(kernels[kernel], desc).asm["ptx"])
            cache[key] = (hashlib.sha1(body.encode()).hexdigest()[:16], body.count(";"))
        sha, n = cache[key]
        out.append({"run": run, "kernel": kernel, "constexprs": {a: str(v) for a, v in desc["consts"].items()},
                    "warps": desc["num_warps"], "stages": desc["num_stages"], "sha": sha, "instructions": n})
    return out


def _in_worktree(rev: str, ops: list[str]) -> list[dict]:
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "tree")
        subprocess.run(["git", "-C", root, "worktree", "add", "--detach", "-q", tree, rev], check=True)
        try:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env.update(PYTHONPATH=tree, TRITON_CACHE_DIR=os.path.join(tmp, "cache"),
                       TRITON_ALLOW_NON_CONSTEXPR_GLOBALS="1")  # older trees had a plain-float global
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--ops", ",".join(ops)], env=env,
                                 cwd=tree, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"fingerprinting {rev} failed:\n{res.stderr[-3000:]}")
            return json.loads(res.stdout)
        finally:
            subprocess.run(["git", "-C", root, "worktree", "remove", "--force", tree], check=False)


def _op_of(row: dict) -> str:
    """The op a recorded launch belongs to."""
    k = row["kernel"]
    if k.startswith(("router_", "select_")):
        return "router"
    if k.startswith("store_kv"):  # hpcops.store_kv: timed in the rope suite, beside the fused prologue
        return "rope"
    return "decode" if k.startswith(("decode_", "plan_")) else k.split("_")[0]


def compare(old: list[dict], new: list[dict]) -> int:
    """Print a run-by-run comparison; return the number of runs that differ."""
    def by_run(rows):
        runs: dict[str, list[dict]] = {}
        for r in rows:
            runs.setdefault(r["run"], []).append(r)
        return runs

    o, n = by_run(old), by_run(new)
    bad = 0
    for run in list(n) + [r for r in o if r not in n]:
        a, b = o.get(run, []), n.get(run, [])
        ka, kb = [r["kernel"] for r in a], [r["kernel"] for r in b]
        if ka != kb:
            status = f"launches differ: {ka} -> {kb}"
        else:
            diff = [f"{x['kernel']} ({x['instructions']} -> {y['instructions']} instr)"
                    for x, y in zip(a, b) if x["sha"] != y["sha"]]
            status = "same PTX" if not diff else "PTX differs: " + ", ".join(diff)
        bad += status != "same PTX"
        print(f"{run:32s} {len(b)} launches  {status}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {OPS}")
    ap.add_argument("--against", metavar="REV", help="compare with the same runs at this git revision")
    ap.add_argument("--check", metavar="FILE", help="compare with fingerprints recorded in FILE (JSON)")
    args = ap.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS)
    if unknown:
        ap.error(f"--ops: unknown {sorted(unknown)}; choose from {OPS}")
    os.environ.pop("TRITON_INTERPRET", None)
    if args.against and args.check:
        ap.error("--against and --check: give one")
    if args.against or args.check:
        if args.check:  # the ops the file records (those whose results are committed)
            with open(args.check) as f:
                old = json.load(f)
            ops = [op for op in ops if any(_op_of(r) == op for r in old)]
            old = [r for r in old if _op_of(r) in ops]
        else:
            old = _in_worktree(args.against, ops)
        sys.exit(1 if compare(old, fingerprint(ops)) else 0)
    json.dump(fingerprint(ops), sys.stdout, indent=1)


if __name__ == "__main__":
    main()
