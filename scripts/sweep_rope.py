"""H200 sweep of the rope prologue's launch shapes (RopeConfig: block_t × num_warps × block_kv).

Every variant is timed in one process on the bench suite's inputs (hpcops.bench.suites.rope builders:
per-layer inputs, CUDA-graph replay, L2-cold), for Hy3's h64/8 and h8/1, bf16 and fp8 (fp8 KV + fp8
q), T = 256, 2048, 8192, 32768. Each variant is first checked against the torch reference (T = 2048);
a variant that fails to compile or to match is reported and skipped. Prints the best variant per
shape against the default and writes rope_sweep.{json,md} under --out.

    python scripts/sweep_rope.py --out bench/results          # ~2-3 min on an H200
    python scripts/sweep_rope.py --tokens 32768 --out /tmp/s  # one T only
    python scripts/sweep_rope.py --smoke --out /tmp/s         # smallest complete run (h8/1, T 256)
    python scripts/sweep_rope.py --dry-run                    # list the variants (CPU)
    python scripts/sweep_rope.py --dry-run --ptx              # + sm_90 compile stats per variant (CPU)

Compiles dominate the first run: they are done up front in --jobs worker processes (each runs every
variant once on tiny inputs, which fills Triton's on-disk cache), so the timing loop only loads them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HEADS = ((64, 8), (8, 1))
TOKENS = (256, 2048, 8192, 32768)
HEAD_DIM = 128
CHECK_T = 2048
DEVICE = "cuda"  # the CPU smoke test (tests/test_rope_bench.py) runs the plumbing on "cpu"
# (block_t, num_warps): q tiles of 8..64 elements per thread (32·block_t/num_warps for GROUP 8)
SHAPES = [(1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (4, 8), (8, 4), (8, 8), (16, 8)]
SMEM_SHAPES = [(2, 4), (4, 4), (4, 8), (8, 8)]  # also timed with RopeConfig.cos_sin_smem
SMOKE_LIMIT: int | None = None  # --smoke: this many shapes (plus the defaults) per head layout


Variant = tuple[int, int, int, bool]  # RopeConfig(block_t, num_warps, block_kv, cos_sin_smem)


def _default(t: int, hq: int, hkv: int) -> Variant:
    from hpcops.rope.prologue import default_config

    c = default_config(t, hq, hkv, HEAD_DIM, "cuda" if _has_gpu() else None)
    return (c.block_t, c.num_warps, c.block_kv, c.cos_sin_smem)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def variants(hq: int, hkv: int) -> list[Variant]:
    """RopeConfig fields for one head layout: the shapes × the default block_kv; the block_kv
    neighbours (½×, 2×, 4×) of the large-T default (4, 8) and of (4, 4); cos/sin through shared
    memory for a few shapes; every T's default."""
    from hpcops.rope.prologue import default_block_kv

    big = 1 << 20
    kv = lambda bt: default_block_kv(bt, big, hq, hkv)
    out = [(bt, w, kv(bt), False) for bt, w in SHAPES[:SMOKE_LIMIT]]
    for bt, w in ((4, 8), (4, 4)) if SMOKE_LIMIT is None else ():
        out += [(bt, w, k, False) for k in (kv(bt) // 2, kv(bt) * 2, kv(bt) * 4) if 1 <= k <= 64]
    out += [(bt, w, kv(bt), True) for bt, w in SMEM_SHAPES[:SMOKE_LIMIT]]
    out += [_default(t, hq, hkv) for t in TOKENS]
    unique: list[Variant] = []
    for v in out:
        if v not in unique:
            unique.append(v)
    return unique


def _name(v: Variant) -> str:
    return f"bt{v[0]}w{v[1]}kv{v[2]}" + ("-smem" if v[3] else "")


# ---- compile ahead (worker processes fill Triton's on-disk cache)

def _tiny_inputs(hq: int, hkv: int, fp8: bool, t: int = 16):
    """Inputs with the specializations of the timed ones (strides, alignment, T % 16 == 0)."""
    from hpcops.bench.suites import rope as suite

    s = suite.Scenario(t, hq, hkv, fp8)
    return s, suite._make_inputs(s, 0, device=DEVICE)


def _compile_job(job: tuple[int, int, bool, list[Variant]]) -> list[tuple[str, str]]:
    hq, hkv, fp8, vs = job
    import torch

    from hpcops.bench.suites import rope as suite

    s, x = _tiny_inputs(hq, hkv, fp8)
    errors = []
    for v in vs:
        try:
            suite._ours(s, v)(x)()
        except Exception as exc:  # noqa: BLE001 - reported by the parent, variant skipped
            errors.append((_name(v), f"{type(exc).__name__}: {str(exc)[:300]}"))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return errors


def precompile(jobs: int) -> dict[tuple[int, int, bool, str], str]:
    """Compile every (heads, dtype, variant) in `jobs` processes; returns the errors met there
    (printed only: the timing process compiles again what is not cached, and reports its own)."""
    work = [(hq, hkv, fp8, [v]) for hq, hkv in HEADS for fp8 in (False, True) for v in variants(hq, hkv)]
    errors: dict[tuple[int, int, bool, str], str] = {}
    t0 = time.time()
    try:
        if jobs <= 1:
            results = list(map(_compile_job, work))
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
                results = list(pool.map(_compile_job, work))
    except Exception as exc:  # noqa: BLE001 - a broken pool only costs time: the loop compiles
        print(f"compile-ahead failed ({type(exc).__name__}: {exc}); compiling in the timing loop", flush=True)
        return errors
    for (hq, hkv, fp8, _), errs in zip(work, results):
        for name, msg in errs:
            errors[(hq, hkv, fp8, name)] = msg
            print(f"compile h{hq}x{hkv} {'fp8' if fp8 else 'bf16'} {name}: {msg}", file=sys.stderr)
    print(f"compiled {len(work)} kernels in {time.time() - t0:.0f} s ({jobs} processes), "
          f"{len(errors)} failed", flush=True)
    return errors


# ---- timing

def _layers(nbytes: int) -> int:
    from hpcops.bench import timing

    return timing.layers_for(nbytes, minimum=2, maximum=16)


def _inputs(hq: int, hkv: int, t: int, layers: int) -> tuple[list[dict], list[dict]]:
    """Per-layer inputs for bf16 and fp8 sharing the qkv/positions/slots (built once: the CPU
    generator is the slow part at T = 32K)."""
    import torch

    from hpcops.bench.suites import rope as suite

    s = suite.Scenario(t, hq, hkv, False)
    bf16, fp8 = [], []
    for layer in range(layers):
        x = suite._make_inputs(s, layer, device=DEVICE)
        bf16.append(x)
        y = dict(x)
        y["k_cache"] = torch.zeros_like(x["k_cache"], dtype=suite.FP8)
        y["v_cache"] = torch.zeros_like(x["v_cache"], dtype=suite.FP8)
        y["q_out"] = torch.empty_like(x["q_out"], dtype=suite.FP8)
        fp8.append(y)
    return bf16, fp8


def _time(scenario, inputs: list[dict], v: Variant) -> float:
    from hpcops.bench import timing
    from hpcops.bench.suites import rope as suite

    return timing.graph_time_us([suite._ours(scenario, v)(x) for x in inputs])


def _copy_gbps() -> float | None:
    from hpcops.bench import timing

    try:
        c = timing.copy_bandwidth_gbps()
    except Exception:  # noqa: BLE001 - a reference only
        return None
    return max(c.values()) if isinstance(c, dict) else float(c)


def run(out: Path, jobs: int) -> int:
    import torch

    from hpcops.bench.suites import rope as suite

    t_start = time.time()
    precompile(jobs)
    copy = _copy_gbps() if DEVICE == "cuda" else None
    print(f"copy bandwidth {copy:.0f} GB/s" if copy else "copy bandwidth: not measured", flush=True)
    results: list[dict] = []
    bad: dict[tuple[int, int, bool, str], str] = {}
    for hq, hkv in HEADS:
        # correctness of every variant first (GPU numerics, T = CHECK_T)
        for fp8 in (False, True):
            s = suite.Scenario(CHECK_T, hq, hkv, fp8)
            x = suite._make_inputs(s, 0, device=DEVICE)
            for v in variants(hq, hkv):
                if (hq, hkv, fp8, _name(v)) in bad:
                    continue
                try:
                    _check_variant(s, x, v)
                except Exception as exc:  # noqa: BLE001 - AssertionError or a compile error
                    bad[(hq, hkv, fp8, _name(v))] = f"check: {type(exc).__name__}: {str(exc)[:300]}"
            del x
        for t in TOKENS:
            layers = _layers(suite.Scenario(t, hq, hkv, False).bytes)
            per_dtype = _inputs(hq, hkv, t, layers)
            for fp8, inputs in zip((False, True), per_dtype):
                s = suite.Scenario(t, hq, hkv, fp8)
                default = _default(t, hq, hkv)
                times = {}
                for v in variants(hq, hkv):
                    if (hq, hkv, fp8, _name(v)) in bad:
                        continue
                    try:
                        us = _time(s, inputs, v)
                    except Exception as exc:  # noqa: BLE001 - report and keep sweeping
                        bad[(hq, hkv, fp8, _name(v))] = f"time: {type(exc).__name__}: {str(exc)[:300]}"
                        continue
                    times[v] = us
                    results.append(dict(case=s.name, hq=hq, hkv=hkv, kv="fp8" if fp8 else "bf16", T=t,
                                        block_t=v[0], num_warps=v[1], block_kv=v[2], cos_sin_smem=v[3],
                                        variant=_name(v), default=v == default,
                                        layers=layers, us=us, gbps=s.bytes / us / 1e3,
                                        pct_copy=(s.bytes / us / 1e3 / copy) if copy else None))
                if not times:
                    print(f"{s.name:22s} no variant ran", flush=True)
                    continue
                best = min(times, key=times.get)
                d_us = times.get(default, float("nan"))
                print(f"{s.name:22s} default {_name(default):12s} {d_us:8.1f} us {s.bytes / d_us / 1e3:6.0f} GB/s | "
                      f"best {_name(best):12s} {times[best]:8.1f} us {s.bytes / times[best] / 1e3:6.0f} GB/s "
                      f"({d_us / times[best]:.2f}x)", flush=True)
            del per_dtype
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for (hq, hkv, fp8, name), msg in sorted(bad.items()):
        print(f"SKIPPED h{hq}x{hkv} {'fp8' if fp8 else 'bf16'} {name}: {msg}", file=sys.stderr)
    _write(out, results, bad, copy, time.time() - t_start)
    return 0


def _check_variant(s, x: dict, v: Variant) -> None:
    """The bench gate (ours vs the torch reference, untouched cache rows) with this config."""
    from hpcops.bench.suites import rope as suite
    from hpcops.rope import prologue

    real = prologue.rope_norm_store_kv

    def with_config(*args, **kw):
        kw.setdefault("config", prologue.RopeConfig(*v))
        return real(*args, **kw)

    prologue.rope_norm_store_kv = with_config  # the gate imports it from the module at call time
    try:
        suite._check(s)(x)
    finally:
        prologue.rope_norm_store_kv = real


def _write(out: Path, results: list[dict], bad: dict, copy: float | None, seconds: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    skipped = [dict(hq=k[0], hkv=k[1], kv="fp8" if k[2] else "bf16", variant=k[3], reason=m) for k, m in bad.items()]
    (out / "rope_sweep.json").write_text(json.dumps({"copy_gbps": copy, "seconds": round(seconds, 1),
                                                     "rows": results, "skipped": skipped}, indent=1))
    lines = ["# rope sweep (H200)", "",
             f"Copy bandwidth {copy:.0f} GB/s. " if copy else "",
             "Per shape: the default launch shape against the fastest (µs per layer, CUDA-graph replay, "
             "L2-cold). `btBwWkvK` = block_t B, num_warps W, block_kv K; `-smem`: cos_sin_smem.", "",
             "| case | default | µs | GB/s | best | µs | GB/s | % copy | speedup |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    cases = sorted({r["case"] for r in results}, key=lambda c: [r["case"] for r in results].index(c))
    for c in cases:
        rows = [r for r in results if r["case"] == c]
        best = min(rows, key=lambda r: r["us"])
        d = next((r for r in rows if r["default"]), None)
        name = lambda r: r["variant"]
        pct = f"{100 * best['pct_copy']:.0f}%" if best["pct_copy"] else ""
        if d:
            lines.append(f"| {c} | {name(d)} | {d['us']:.1f} | {d['gbps']:.0f} | {name(best)} | {best['us']:.1f} | "
                         f"{best['gbps']:.0f} | {pct} | {d['us'] / best['us']:.2f} |")
        else:
            lines.append(f"| {c} | (failed) | | | {name(best)} | {best['us']:.1f} | {best['gbps']:.0f} | {pct} | |")
    lines += ["", "## All variants", "", "| case | variant | µs | GB/s | default |", "|---|---|---:|---:|---|"]
    lines += [f"| {r['case']} | {r['variant']} | {r['us']:.1f} | {r['gbps']:.0f} | {'yes' if r['default'] else ''} |"
              for r in results]
    if skipped:
        lines += ["", "## Skipped", ""] + [f"- h{s['hq']}x{s['hkv']} {s['kv']} {s['variant']}: {s['reason']}"
                                           for s in skipped]
    (out / "rope_sweep.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'rope_sweep.md'} and rope_sweep.json ({seconds:.0f} s)")


# ---- CPU: list the variants, optionally with their sm_90 compile statistics

def dry_run(ptx: bool) -> int:
    for hq, hkv in HEADS:
        vs = variants(hq, hkv)
        defaults: dict[Variant, list[int]] = {}
        for t in TOKENS:
            defaults.setdefault(_default(t, hq, hkv), []).append(t)
        print(f"h{hq}/{hkv}: {len(vs)} variants × bf16/fp8 × T {list(TOKENS)}")
        for v in vs:
            at = ",".join(map(str, defaults.get(v, [])))
            line = f"  {_name(v):12s} {'(default at T=' + at + ')' if at else '':27s}"
            if ptx:
                line += "  " + " | ".join(_ptx_summary(hq, hkv, fp8, v) for fp8 in (False, True))
            print(line, flush=True)
    n = sum(len(variants(hq, hkv)) for hq, hkv in HEADS)
    print(f"{2 * n} compiles, {2 * n * len(TOKENS)} timings")
    return 0


def _ptx_summary(hq: int, hkv: int, fp8: bool, v: Variant) -> str:
    try:
        s = ptx_stats(hq, hkv, fp8, v)
    except Exception as exc:  # noqa: BLE001
        return f"{'fp8' if fp8 else 'bf16'}: compile error {type(exc).__name__}"
    return (f"{'fp8 ' if fp8 else 'bf16'} regs {s['regs']:3d} spill {s['spill']} q {s['q_sass']:4d} "
            f"kv {s['kv_sass']:4d} SASS, ld/st.v4 {s['ld_v4']}/{s['st_v4']}")


def ptx_stats(hq: int, hkv: int, fp8: bool, v: Variant, roles: bool = True) -> dict:
    """sm_90 compile of one variant (as the launcher specializes it at large T): registers, spills,
    16-byte global accesses, and the SASS length of each program kind (the q / kv branches compiled
    alone: the executed length of one program, up to its last EXIT)."""
    import importlib.util
    import inspect
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hpcops.rope import _rope_kernels

    def build(kernel, keep: dict) -> dict:
        params = list(inspect.signature(kernel.fn).parameters)
        kv = "fp8e4nv" if fp8 else "bf16"
        ptr = {"qkv_ptr": "bf16", "pos_ptr": "i64", "cs_ptr": "fp32", "qw_ptr": "fp32", "kw_ptr": "fp32",
               "kc_ptr": kv, "vc_ptr": kv, "slot_ptr": "i64", "ks_ptr": "fp32", "vs_ptr": "fp32", "q_ptr": kv,
               "qs_ptr": "fp32"}
        g = hq // hkv
        const = dict(HQ=hq, HKV=hkv, HKV_P=triton.next_power_of_2(hkv), D=HEAD_DIM, D_P=HEAD_DIM, GROUP=g,
                     GROUP_P=triton.next_power_of_2(g), HALF=HEAD_DIM // 2, HALF_P=HEAD_DIM // 2, TAIL_P=1,
                     HAS_TAIL=False, NEOX=True, ORDER=1, KV_FP8=fp8, Q_FP8=fp8, BLOCK_T=v[0], BLOCK_KV=v[2],
                     IDX64=False, CACHE_I64=False, SLOT_LINEAR=True, CS_SMEM=v[3])
        const.update(dict.fromkeys(("s_qkv_d", "s_cs_d", "s_qw", "s_kw", "s_kc_d", "s_vc_d", "s_q_d", "s_qs_h"), 1))
        sig = {p: "*" + ptr[p] if p in ptr else "constexpr" if p in const else "fp32" if p == "eps" else "i32"
               for p in params}
        # what Triton's launcher specializes at the swept shapes: pointers, T, page 64 and every stride
        # (Hkv·128, 128, …) are multiples of 16, except q_scale's row stride Hq = 8
        aligned = {p for p in params if p.endswith("_ptr") or p.startswith("s_") and p not in const}
        aligned |= {"num_tokens", "block_size"}
        if hq % 16:
            aligned.discard("s_qs_t")
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in aligned}
        src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                        constexprs={(params.index(n),): c for n, c in const.items() if n in params})
        cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": v[1]})
        ptx_text = cc.asm["ptx"]
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        with tempfile.TemporaryDirectory() as td:
            path = os.path.join(td, "k.cubin")
            Path(path).write_bytes(cc.asm["cubin"])
            res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", path], capture_output=True,
                                 text=True).stdout
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", path], capture_output=True,
                                  text=True).stdout
        ins = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
        hot = max((i + 1 for i, ln in enumerate(ins) if "EXIT" in ln), default=len(ins))
        m = re.search(r"REG:(\d+)", res)
        out = {"regs": int(m.group(1)) if m else -1, "sass": hot,
               "spill": len(re.findall(r"\b(?:st|ld)\.local", ptx_text)),
               "ld_v4": len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx_text)),
               "st_v4": len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx_text))}
        keep.update(ptx=ptx_text, sass=sass)
        return out

    keep: dict = {}
    s = build(_rope_kernels.rope_norm_store_kv_fused_kernel, keep)
    if roles:  # the same source with the program-kind branch fixed, to count one program's work
        src = Path(_rope_kernels.__file__).read_text()
        marker = "if pid < num_q:"
        assert marker in src, "sweep_rope.ptx_stats: the kernel's role branch moved"
        for role, cond in (("q", "True"), ("kv", "False")):
            with tempfile.TemporaryDirectory() as td:
                path = os.path.join(td, f"_rope_{role}.py")
                Path(path).write_text(src.replace(marker, f"if {cond}:"))
                spec = importlib.util.spec_from_file_location(f"_rope_{role}", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                s[f"{role}_sass"] = build(mod.rope_norm_store_kv_fused_kernel, {})["sass"]
    return s


def main(argv: Iterable[str] | None = None) -> int:
    global TOKENS, HEADS, SMOKE_LIMIT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="processes compiling ahead (1: compile in the timing loop's process)")
    ap.add_argument("--dry-run", action="store_true", help="list the variants; no GPU needed")
    ap.add_argument("--ptx", action="store_true", help="with --dry-run: sm_90 compile statistics per variant")
    ap.add_argument("--tokens", default=None, help=f"comma-separated T values (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest complete run: h8/1, T 256 (or --tokens), one plain and one smem shape")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.tokens:
        TOKENS = tuple(int(t) for t in args.tokens.split(","))
    if args.smoke:
        HEADS, SMOKE_LIMIT = ((8, 1),), 1
        TOKENS = TOKENS if args.tokens else (256,)
    if args.dry_run:
        if args.ptx:
            os.environ.pop("TRITON_INTERPRET", None)
        return dry_run(args.ptx)
    if not _has_gpu():
        print("the sweep times on a CUDA GPU; none is visible (use --dry-run)", file=sys.stderr)
        return 2
    return run(Path(args.out), args.jobs)


if __name__ == "__main__":
    raise SystemExit(main())
