"""Bench suite `decode`: the blog's six decode scenarios (DESIGN.md), h8/1 and h64/8, fp8 and bf16
KV, page 64, head_dim 128; and the blog's table-4 decode rows (8q1s1k, 16q1s2k, 32q1s1k: 8x1K, 16x2K, 32x1K) at
h64/8 bf16 (its 64q1s4k is 64x4K h64/8 bf16).

Implementations, each timed on the same inputs in the same run (L2-cold, one CUDA graph of layers):
- `hpcops` — load-balanced persistent schedule (plan computed once per step, outside the graph);
- `hpcops-tail` — the same with the splits merged in the attention kernel's tail (`DecodeConfig.tail_merge`,
  opt-in: no combine kernel);
- `hpcops-static` — the same inner loop over a classic static split-KV grid (the blog's ablation);
- `hpcops-fp8q` — fp8 KV with an fp8 query (as the fused prologue emits it): by default, on an H200, the
  Gluon kernel with the tail merge and 3 programs an SM (the plan told the call's dtypes: `plan_kernel`);
- `hpcops-gluon` — the dynamic schedule on the Hopper kernel forced (`DecodeConfig.gluon`; fp8 q over fp8 KV, bf16 q
  over bf16 KV), `unavailable` where it does not apply (`gluon_unsupported_reason`: a CPU, a GPU other than sm_90);
- `hpcops-plan` — the plan step alone (once per decode step, not per layer);
- `flashinfer-decode` / `flashinfer-tc` — FlashInfer's BatchDecodeWithPagedKVCacheWrapper without
  and with tensor cores (its two decode paths), planned outside the graph.

`hpcops bench decode --grid` runs the generality grid instead (GQA, head_dim, page, KV dtype, lengths; suite
`decode-grid`, `decode_grid.py`), with these inputs and adapters at other pages and head dims.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

import hpcops
from hpcops.attention import reference as ref
from hpcops.bench.registry import Case, Impl, PeerUnavailable, flashinfer_workspace
from hpcops.bench.scenarios import DECODE_HEADS, DECODE_SCENARIOS, TABLE4_DECODE, parse_lengths
from hpcops.quant import quantize_per_token_head
from hpcops.testing import assert_close

FP8 = torch.float8_e4m3fn
PAGE = 64
HEAD_DIM = 128
K_SCALE, V_SCALE = 0.02, 0.03


@dataclass(frozen=True)
class Scenario:
    spec: str
    hq: int
    hkv: int
    fp8: bool

    @property
    def name(self) -> str:
        return f"{self.spec} h{self.hq}/{self.hkv} {'fp8' if self.fp8 else 'bf16'}"

    @property
    def lens(self) -> list[int]:
        return parse_lengths(self.spec)

    @property
    def bytes(self) -> int:
        elem = 1 if self.fp8 else 2
        kv = sum(self.lens) * self.hkv * HEAD_DIM * 2 * elem
        qo = len(self.lens) * self.hq * HEAD_DIM * 2 * 2
        return kv + qo


def make_decode_inputs(lens: list[int], hq: int, hkv: int, fp8: bool, seed: int, device: str = "cuda", *,
                       page: int = PAGE, head_dim: int = HEAD_DIM) -> dict:
    """Random paged caches (vLLM's packed K|V layout, `page` tokens per block), shuffled pages, bf16 q
    `[B, hq, head_dim]` (and its fp8 quantization); `max_seq_len`, the step's longest request as a host int (what a
    serving step knows, and tells `plan_decode`)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = [-(-n // page) for n in lens]
    num_blocks = sum(nblk) + 1
    packed = torch.randn((num_blocks, page, hkv, 2 * head_dim), generator=g, device=device, dtype=torch.bfloat16)
    if fp8:
        packed[..., :head_dim] /= K_SCALE
        packed[..., head_dim:] /= V_SCALE
        packed = packed.to(FP8)
    perm = torch.randperm(num_blocks, generator=g, device=device).to(torch.int32)
    table = torch.zeros((len(lens), max(nblk)), dtype=torch.int32, device=device)
    cursor = 0
    for b, n in enumerate(nblk):
        table[b, :n] = perm[cursor:cursor + n]
        cursor += n
    q = torch.randn((len(lens), hq, head_dim), generator=g, device=device, dtype=torch.bfloat16)
    x = dict(q=q, k_cache=packed[..., :head_dim], v_cache=packed[..., head_dim:], block_table=table,
             seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), max_seq_len=max(lens, default=0),
             packed=packed,
             k_scale=torch.tensor([K_SCALE], device=device) if fp8 else None,
             v_scale=torch.tensor([V_SCALE], device=device) if fp8 else None)
    if fp8:
        x["q8"], x["q_scale"] = quantize_per_token_head(q)
    x["out"] = torch.empty_like(q)
    return x


def _ours(schedule: str, fp8q: bool = False, knobs: dict | None = None):
    """hpcops' decode, planned outside the graph (once a step in a model); `knobs`: a DecodeConfig change for
    this row alone (the plan built under it too)."""
    def prepare(x):
        from hpcops.attention.decode import decode_config_changed

        plan = None
        q, qs = (x["q8"], x["q_scale"]) if fp8q else (x["q"], None)
        if schedule == "dynamic":  # with what the calls take, as a model's step tells it (`plan_kernel`)
            _, page, hkv, d = x["k_cache"].shape
            with decode_config_changed(**(knobs or {})):
                plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page, num_q_heads=q.shape[1],
                                          head_dim=d, q_dtype=q.dtype, kv_dtype=x["k_cache"].dtype,
                                          max_seq_len=x["max_seq_len"])

        def run():
            with decode_config_changed(**(knobs or {})):
                return hpcops.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                               plan=plan, schedule=schedule, k_scale=x["k_scale"],
                                               v_scale=x["v_scale"], q_scale=qs, out=x["out"])

        if knobs:  # a row off the defaults: its own correctness gate
            x["out"].fill_(float("nan"))
            want = ref.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                        k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=qs)
            assert_close(want, run(), name=f"decode ({knobs})")
        return run
    return prepare


def _gluon():
    """The dynamic schedule with `DecodeConfig.gluon` forced on (the Hopper kernel, with the combine: a plan
    without hints), fp8 q over fp8 KV; gated here."""

    def prepare(x):
        from hpcops.attention import decode as dec

        q, qs = (x["q8"], x["q_scale"]) if "q8" in x else (x["q"], None)
        _, page, hkv, _ = x["k_cache"].shape
        why = dec.gluon_unsupported_reason(q, x["k_cache"], x["v_cache"], q.shape[1] // hkv)
        if why is not None:
            raise PeerUnavailable(f"the Gluon kernel does not apply here: {why}")
        plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page)

        def run():
            with dec.decode_config_changed(gluon=True):
                return hpcops.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                               plan=plan, k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=qs,
                                               out=x["out"])

        x["out"].fill_(float("nan"))
        want = ref.decode_attention(q, x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                    k_scale=x["k_scale"], v_scale=x["v_scale"], q_scale=qs)
        assert_close(want, run(), name="decode (gluon)")
        return run
    return prepare


def _plan_step(x):
    hkv, page = x["k_cache"].shape[2], x["k_cache"].shape[1]
    plan = hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page)
    return lambda: hpcops.plan_decode(x["seq_lens"], num_kv_heads=hkv, block_size=page, out=plan)


def _flashinfer(tensor_cores: bool):
    def prepare(x):
        try:
            import flashinfer
        except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent
            raise PeerUnavailable(f"flashinfer not importable: {exc}") from exc
        lens = x["seq_lens"]
        b = lens.shape[0]
        _, page, hkv, d = x["k_cache"].shape
        nblk = (lens + page - 1) // page
        indptr = torch.zeros(b + 1, dtype=torch.int32, device=lens.device)
        indptr[1:] = torch.cumsum(nblk, 0)
        cols = torch.arange(x["block_table"].shape[1], device=lens.device)[None, :]
        indices = x["block_table"][cols < nblk[:, None]].contiguous()
        last = (lens - (nblk - 1) * page).to(torch.int32)
        ws = flashinfer_workspace(lens.device)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last)
        w.plan(indptr, indices, last, x["q"].shape[1], hkv, d, page, q_data_type=torch.bfloat16,
               kv_data_type=x["k_cache"].dtype)
        kw = {}
        if x["k_scale"] is not None:
            kw = dict(k_scale=K_SCALE, v_scale=V_SCALE)
        cache = (x["k_cache"], x["v_cache"])
        return lambda: w.run(x["q"], cache, out=x["out"], **kw)
    return prepare


def _check(x):
    got = hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                  k_scale=x["k_scale"], v_scale=x["v_scale"])
    want = ref.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                k_scale=x["k_scale"], v_scale=x["v_scale"])
    assert_close(want, got, name="decode (dynamic)")
    got = hpcops.decode_attention(x["q"], x["k_cache"], x["v_cache"], x["block_table"], x["seq_lens"],
                                  schedule="static", k_scale=x["k_scale"], v_scale=x["v_scale"])
    assert_close(want, got, name="decode (static)")


def scenarios(quick: bool = False) -> list[Scenario]:
    specs = DECODE_SCENARIOS if not quick else ("64x4K", "1x128K+31x4K")
    table4 = [] if quick else [Scenario(s, 64, 8, False) for s in TABLE4_DECODE if s not in specs]
    return [Scenario(s, hq, hkv, fp8) for hq, hkv in DECODE_HEADS for fp8 in (True, False) for s in specs] + table4


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    for sc in scenarios(opts.get("quick", False)):
        impls = [Impl("hpcops", _ours("dynamic"), ours=True),
                 Impl("hpcops-tail", _ours("dynamic", knobs=dict(tail_merge=True)), ours=True),
                 Impl("hpcops-static", _ours("static"), ours=True)]
        if sc.fp8:
            impls.append(Impl("hpcops-fp8q", _ours("dynamic", fp8q=True), ours=True))
        impls += [Impl("hpcops-gluon", _gluon(), ours=True),
                  Impl("hpcops-plan", _plan_step, ours=True, per_step=True),
                  Impl("flashinfer-decode", _flashinfer(False)),
                  Impl("flashinfer-tc", _flashinfer(True))]
        yield Case(
            suite="decode", name=sc.name, impls=impls, bytes=sc.bytes, check=_check,
            make_inputs=lambda layer, device="cuda", sc=sc: make_decode_inputs(sc.lens, sc.hq, sc.hkv, sc.fp8,
                                                                                 seed=layer, device=device),
            params=dict(spec=sc.spec, hq=sc.hq, hkv=sc.hkv, kv="fp8" if sc.fp8 else "bf16", page=PAGE, d=HEAD_DIM),
            command=f"hpcops bench decode --only '{sc.name}'",
        )
