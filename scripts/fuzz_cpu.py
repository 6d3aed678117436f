"""Random-case fuzzing of every kernel against its torch reference, on the CPU (Triton's interpreter).

Draws cases from the whole supported space of each op (GQA ratios, head dims, page sizes, q_len,
dtypes, fp8 paths, strided/packed caches, odd lengths around page boundaries, configs) and runs them
through the CPU tier's own runners and tolerances (tests/test_*.py), with the interpreter fidelity
repairs installed as in the test suite. A failing case is printed with its seed and fields so it can
be replayed (`--seed S --ops OP --cases 1`) and turned into a test.

    python scripts/fuzz_cpu.py --minutes 20               # all ops, round-robin
    python scripts/fuzz_cpu.py --ops decode,rope --cases 50 --seed 7

Not part of CI (minutes of interpreter time); exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton kernels
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from hpcops import _interpreter  # noqa: E402

_interpreter.install()  # as tests/conftest.py: also under HPCOPS_INTERPRETER_REPAIR=0

import test_decode  # noqa: E402
import test_moe  # noqa: E402
import test_prefill  # noqa: E402
import test_rope  # noqa: E402

from hpcops.attention.prefill import PrefillConfig  # noqa: E402

FP8 = torch.float8_e4m3fn
OPS = ("decode", "prefill", "rope", "moe")


def _len_near(rng: random.Random, bs: int, lo: int = 1, hi: int = 300) -> int:
    """A sequence length, often a page boundary ±1."""
    if rng.random() < 0.5:
        n = bs * rng.randint(1, max(1, hi // bs)) + rng.choice((-1, 0, 1))
    else:
        n = rng.randint(lo, hi)
    return max(lo, min(hi, n))


def decode_case(rng: random.Random):
    hkv = rng.choice((1, 1, 2, 3))
    g = rng.choice((1, 2, 3, 4, 5, 7, 8, 16))
    d = rng.choice((64, 64, 96, 128, 256))
    bs = rng.choice((16, 32, 64, 128, 256))
    q_len = rng.choice((1, 1, 1, 2, 3, 4, 8))
    kv = rng.choice(("bf16", "fp16", "fp8", "fp8q"))
    lens = [_len_near(rng, bs, lo=q_len, hi=400 if d <= 128 else 200) for _ in range(rng.randint(1, 5))]
    if q_len == 1 and rng.random() < 0.2:
        lens[rng.randrange(len(lens))] = 0  # an empty sequence: zeros out
    # now and then a bf16 q past fp16's range (the MMA over fp8 KV runs in fp16: session 54's NaN)
    q_mag = rng.choice((1e3, 1e5)) if kv in ("bf16", "fp8", "fp8q") and rng.random() < 0.15 else 1.0
    case = test_decode.Case(tuple(lens), hkv * g, hkv, d, bs, q_len=q_len, kv=kv, packed=rng.random() < 0.5,
                            programs=rng.randint(1, 8), min_tiles=rng.randint(1, 4), q_mag=q_mag)
    schedule = rng.choice(("dynamic", "static"))
    return f"{case} schedule={schedule}", lambda: test_decode.test_decode_matches_reference(case, schedule, "cpu")


def prefill_case(rng: random.Random):
    hkv = rng.choice((1, 2, 3))
    g = rng.choice((1, 2, 3, 4, 8))
    d = rng.choice((64, 64, 128, 256))
    bs = rng.choice((16, 32, 64))
    kv_dtype = rng.choice((torch.bfloat16, torch.float16, FP8))
    q_dtype = torch.float16 if kv_dtype == torch.float16 else torch.bfloat16
    q_fp8 = kv_dtype == FP8 and rng.random() < 0.4
    seq_lens, q_lens = [], []
    for _ in range(rng.randint(1, 3)):
        s = _len_near(rng, bs, hi=150 if d <= 128 else 80)
        q_lens.append(s if rng.random() < 0.4 else rng.randint(1, s))  # prefill or extend
        seq_lens.append(s)
    block_m = rng.choice((16, 32, 64))
    block_n = rng.choice((16, 32, 64))
    fp8_any = kv_dtype == FP8
    config = PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=1,
                           tma=rng.choice((None, False)),
                           pv_fp8=fp8_any and block_n >= 32 and rng.random() < 0.3,
                           quant_q=fp8_any and not q_fp8 and rng.random() < 0.3,
                           fma_scale=rng.random() < 0.7, heads_inner=rng.random() < 0.3)
    case = test_prefill.Case("fuzz", seq_lens, q_lens, hq=hkv * g, hkv=hkv, head_dim=d, block_size=bs,
                             q_dtype=q_dtype, kv_dtype=kv_dtype, q_fp8=q_fp8, packed=rng.random() < 0.5,
                             config=config, pad_rows=rng.choice((0, 0, 3)))
    return repr(case), lambda: test_prefill._run_case(case, "cpu")


def rope_case(rng: random.Random):
    d = rng.choice((64, 128, 256))
    order = rng.choice(("norm_rope", "rope_norm", "rope"))
    style = rng.choice(("neox", "gptj"))
    rot = rng.choice((None, None, 2 * rng.randint(8, d // 2)))
    kv = rng.choice((torch.bfloat16, FP8))
    dtype = rng.choice((torch.bfloat16, torch.float16))
    hkv = rng.choice((1, 2, 3))
    case = test_rope.Case(t=rng.randint(1, 40), hq=hkv * rng.choice((1, 2, 3, 4, 8)), hkv=hkv, d=d, order=order,
                          style=style, rot=rot, kv=kv if kv == FP8 else dtype, quantize_q=rng.random() < 0.4,
                          packed=rng.random() < 0.5, skip=rng.random() < 0.7, dtype=dtype,
                          cs_dtype=rng.choice((torch.float32, dtype)), block_size=rng.choice((16, 32, 64)),
                          block_t=rng.choice((1, 2, 4, 8, 16)), block_kv=rng.choice((None, 1, 4, 8)),
                          strided_blocks=rng.random() < 0.3, cs_smem=rng.random() < 0.3,
                          pad_cols=rng.choice((0, 8, 24)))
    return case.id, lambda: test_rope.run_and_compare(case, "cpu")


def moe_case(rng: random.Random):
    quant = rng.choice(("none", "fp8_tensor", "fp8_block"))
    e = rng.choice((4, 6, 8, 12))
    k = rng.randint(1, min(e, 6))
    inter = rng.choice((128, 256)) if quant == "fp8_block" else rng.choice((64, 128, 192))
    case = test_moe.Case(rng.choice((0, 1, 2, 3, 5, 7, 9, 16, 33)), k=k, E=e, H=rng.choice((128, 200, 256)),
                         inter=inter, quant=quant, static=rng.random() < 0.5,
                         dtype=rng.choice((torch.bfloat16, torch.float16)) if quant == "none" else torch.bfloat16,
                         shared=rng.random() < 0.5, ep=rng.random() < 0.3, use_out=rng.random() < 0.5,
                         act_mul=rng.choice(("fp32", "bf16")),
                         block_n=rng.choice((None, 32, 64)) if quant == "fp8_block" else None,
                         prequant=rng.choice((None, True)) if quant != "none" else None)
    return case.id, lambda: test_moe.test_fused_moe(case, "cpu")


MAKERS = {"decode": decode_case, "prefill": prefill_case, "rope": rope_case, "moe": moe_case}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {OPS}")
    ap.add_argument("--minutes", type=float, default=10.0, help="stop drawing new cases after this long")
    ap.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: no limit)")
    ap.add_argument("--seed", type=int, default=0, help="first case seed; case i uses seed + i")
    args = ap.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    if set(ops) - set(OPS):
        ap.error(f"--ops: unknown {sorted(set(ops) - set(OPS))}; choose from {OPS}")
    start, n, failed, rejected = time.time(), 0, [], {}
    while (time.time() - start) / 60 < args.minutes and (not args.cases or n < args.cases):
        seed = args.seed + n
        op = ops[n % len(ops)]
        n += 1
        rng = random.Random(seed)
        torch.manual_seed(seed)
        desc, run = MAKERS[op](rng)
        t0 = time.time()
        try:
            run()
            status = "ok"
        except ValueError as exc:  # a combination the op refuses with a clear error: count it, look at it
            status = f"refused: {exc}"
            rejected[str(exc)[:120]] = rejected.get(str(exc)[:120], 0) + 1
        except Exception:  # noqa: BLE001 - every other outcome is a finding
            status = "FAILED"
            failed.append((seed, op, desc, traceback.format_exc(limit=3)))
        print(f"[{n:4d}] seed={seed} {op:8s} {time.time() - t0:5.1f}s {status[:100]}  {desc[:160]}", flush=True)
    print(f"\n{n} cases, {len(failed)} failed, {sum(rejected.values())} refused")
    for msg, count in sorted(rejected.items(), key=lambda kv: -kv[1]):
        print(f"  refused ×{count}: {msg}")
    for seed, op, desc, tb in failed:
        print(f"\nFAILED seed={seed} op={op}: {desc}\n{tb}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
