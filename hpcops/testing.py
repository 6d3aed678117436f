"""Helpers shared by the test tiers and `hpcops bench --check`: one closeness check, the routing comparison up to
near ties, paged-KV factories,
and recording kernel launches to compile them ahead of time for sm_90 (no GPU needed)."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

# Normalized tolerances (max error / max|ref|, RMS error / RMS(ref)) by the output dtype, for outputs
# computed in fp32 inside the kernel and rounded once at the end.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-3, 5e-4),
    torch.float16: (5e-3, 2e-3),
    torch.bfloat16: (2e-2, 8e-3),
}


def relative_errors(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(max |out − ref| / max |ref|, rms(out − ref) / rms(ref)) in float64 on the tensors' device, the two
    measures `assert_close` bounds (a reference of all zeros counts as 1e-6)."""
    r, o = ref.double(), out.double()
    err = (o - r).abs()
    return (err.max().item() / max(r.abs().max().item(), 1e-6),
            err.pow(2).mean().sqrt().item() / max(r.pow(2).mean().sqrt().item(), 1e-6))


def assert_close(ref: torch.Tensor, out: torch.Tensor, *, name: str = "output", maxtol: float | None = None,
                 rmstol: float | None = None) -> None:
    """Assert `out` ≈ `ref` by normalized max and RMS error; NaN/Inf in `out` where `ref` is finite fails.

    1-byte (fp8) outputs: `ref` is cast to that dtype and each value must be within 1 fp8 ulp.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    if out.dtype.itemsize == 1 and out.dtype.is_floating_point:
        _assert_fp8_close(ref, out, name)
        return
    dmax, drms = TOLERANCES.get(out.dtype, TOLERANCES[torch.float32])
    maxtol = dmax if maxtol is None else maxtol
    rmstol = drms if rmstol is None else rmstol
    r, o = ref.double().cpu(), out.double().cpu()
    bad = ~torch.isfinite(o) & torch.isfinite(r)
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(f"{name}: {int(bad.sum())} non-finite values where the reference is finite, "
                             f"first at {idx}")
    if r.numel() == 0:
        return
    max_rel, rms_rel = relative_errors(r, o)
    if max_rel > maxtol or rms_rel > rmstol:
        err = (o - r).abs()
        worst = torch.unravel_index(err.argmax(), err.shape)
        where = tuple(int(i) for i in worst)
        raise AssertionError(
            f"{name}: max err/max|ref| = {max_rel:.3e} (tol {maxtol:.1e}), rms err/rms(ref) = {rms_rel:.3e} "
            f"(tol {rmstol:.1e}); worst at {where}: got {o[where].item():.6g}, want {r[where].item():.6g}")


def _assert_fp8_close(ref: torch.Tensor, out: torch.Tensor, name: str) -> None:
    want = ref.float().cpu().to(out.dtype).float()
    got = out.cpu().float()
    both_nan = torch.isnan(want) & torch.isnan(got)
    # one ulp of e4m3 at |x| is 2**(floor(log2|x|) - 3) (subnormals: 2**-9)
    mag = torch.maximum(want.abs(), got.abs()).clamp_min(2.0 ** -6)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 3)
    ok = both_nan | ((want - got).abs() <= ulp * 1.0001)
    if not ok.all():
        i = tuple(int(v) for v in (~ok).nonzero()[0])
        raise AssertionError(f"{name}: {int((~ok).sum())} fp8 values more than 1 ulp off; "
                             f"first at {i}: got {got[i].item()}, want {want[i].item()}")


def assert_routes_agree(weights: torch.Tensor, ids: torch.Tensor, want_weights: torch.Tensor,
                        want_ids: torch.Tensor, logits: torch.Tensor, *, scoring: str = "softmax",
                        bias: torch.Tensor | None = None, tie_tol: float = 1e-4, rtol: float = 1e-5,
                        atol: float = 1e-6) -> None:
    """Two top-k routings of the same logits summed in different orders (a kernel's against the reference's):
    the sets of expert ids equal in every token except where the reference's k-th and (k+1)-th selection scores
    (the logits; sigmoid + bias for "sigmoid") are closer than `tie_tol`, and the weights, paired with their ids,
    close where the sets agree. The order within a token's top-k is not compared: it is the order of the scores,
    and two chosen experts' scores can tie within the sums' roundings."""
    ids, order = ids.long().sort(dim=-1)
    weights = weights.gather(-1, order)
    want_ids, want_order = want_ids.long().sort(dim=-1)
    want_weights = want_weights.gather(-1, want_order)
    same = (ids == want_ids).all(-1)
    if not bool(same.all()):
        k = ids.shape[1]
        if k >= logits.shape[-1]:
            raise AssertionError("expert ids differ with every expert chosen")
        scores = logits.float()
        if scoring == "sigmoid":
            scores = torch.sigmoid(scores) + (bias if bias is not None else 0.0)
        top = torch.topk(scores, k + 1, dim=-1).values
        far = ~same & ((top[:, k - 1] - top[:, k]).abs() >= tie_tol)
        if bool(far.any()):
            raise AssertionError(f"expert ids differ in {int(far.sum())} tokens beyond near ties (gap ≥ {tie_tol})")
    torch.testing.assert_close(weights[same], want_weights[same], rtol=rtol, atol=atol)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN (so unwritten elements fail the checks)."""
    return torch.full_like(t, float("nan"))


@dataclass
class PagedKV:
    """A random paged KV cache for tests and benchmarks, in vLLM's layout.

    `k_cache`, `v_cache`: [num_blocks, block_size, num_kv_heads, head_dim] (views into one packed
    buffer when `packed=True`, as vLLM hands them); `block_table`: int32 [B, max_blocks] with
    distinct, shuffled pages; `seq_lens`: int32 [B]. Values are N(0,1) (× 1/k_scale for fp8).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def make_paged_kv(seq_lens: list[int], *, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                  packed: bool = False, extra_blocks: int = 1, extra_cols: int = 0,
                  generator: torch.Generator | None = None) -> PagedKV:
    """Build a random paged cache holding `seq_lens` tokens per request.

    `packed=True` gives vLLM's LBNHC layout: one buffer [N, block, H, 2D] split into K|V views
    (token stride H·2D). `extra_cols` widens the block table beyond what the longest sequence needs.
    """
    device = torch.device(device)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    fp8 = dtype == torch.float8_e4m3fn
    store = torch.bfloat16 if fp8 else dtype
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if packed:
        buf = torch.randn((*shape[:3], 2 * head_dim), generator=generator).to(store)
        k, v = buf[..., :head_dim], buf[..., head_dim:]
    else:
        k = torch.randn(shape, generator=generator).to(store)
        v = torch.randn(shape, generator=generator).to(store)
    k_scale = v_scale = None
    if fp8:
        k_scale = torch.tensor([0.02], dtype=torch.float32)
        v_scale = torch.tensor([0.03], dtype=torch.float32)
        if packed:
            buf8 = torch.cat([(k.float() / k_scale), (v.float() / v_scale)], dim=-1).to(torch.float8_e4m3fn)
            k, v = buf8[..., :head_dim], buf8[..., head_dim:]
        else:
            k = (k.float() / k_scale).to(torch.float8_e4m3fn)
            v = (v.float() / v_scale).to(torch.float8_e4m3fn)
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    perm = torch.randperm(num_blocks, generator=generator)
    max_blocks = max(blocks_per_seq, default=0) + extra_cols
    table = torch.zeros((len(seq_lens), max(max_blocks, 1)), dtype=torch.int32)
    cursor = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = perm[cursor:cursor + n].to(torch.int32)
        cursor += n
    if packed:
        whole = torch.cat([k, v], dim=-1).to(device)
        k, v = whole[..., :head_dim], whole[..., head_dim:]
    else:
        k, v = k.to(device), v.to(device)
    return PagedKV(k, v, table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   k_scale, v_scale)


def capture_graph(fn: Callable[[], Any], *, capture_error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run `fn` once on a side stream (compilation, lazy allocations stay outside the capture), then
    capture one call in a CUDA graph; returns the graph and what the captured call returned (tensors
    the replays write). `capture_error_mode="thread_local"` where another thread may touch CUDA during
    the capture (a NCCL process group's watchdog)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        result = fn()
    return graph, result


# ---- recorded launches, compiled ahead of time ------------------------------------------------------

_SIG_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
              torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")


class LaunchRecorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kw)` appends (name, args, kw) to
    `log` and launches nothing."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append((self.name, args, kw))


@contextlib.contextmanager
def recorded_launches(*modules: ModuleType) -> Iterator[list]:
    """Within the block every `*_kernel` JIT function of `modules` is a `LaunchRecorder`; yields their
    shared log [(kernel name, args, kwargs)] in launch order. Pass the modules that hold the kernels and
    those that imported them by name."""
    from triton.runtime.jit import KernelInterface  # JIT and interpreted kernels alike

    log: list = []
    saved = [(m, a, v) for m in modules for a, v in vars(m).items()
             if isinstance(v, KernelInterface) and a.endswith("_kernel")]
    # the launchers' device check accepts CPU tensors while nothing launches (`ptx_fingerprint --against`
    # may import an older hpcops without this context manager)
    replaced = getattr(importlib.import_module("hpcops._checks"), "kernels_replaced", contextlib.nullcontext)
    try:
        for m, a, _ in saved:
            setattr(m, a, LaunchRecorder(a, log))
        with replaced():
            yield log
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def describe_launch(fn, args: tuple, kwargs: dict) -> dict:
    """A recorded launch of JIT function `fn` as `compile_launch` inputs, JSON-serializable: argument
    types, constexprs (triton dtypes as "tl.<name>"), the arguments the JIT specializes as divisible
    by 16 (tensors, ints ≡ 0 mod 16), and the launch options."""
    sig, div16 = {}, []
    # tensors given by keyword (runtime arguments: never a constexpr) are described as the positional ones
    by_kw = [(a, kwargs[a]) for a in fn.arg_names[len(args):] if isinstance(kwargs.get(a), torch.Tensor)]
    for a, v in [*zip(fn.arg_names, args), *by_kw]:
        if isinstance(v, torch.Tensor):
            sig[a] = "*" + _SIG_TYPES[v.dtype]
            div16.append(a)  # torch allocations are 16-byte aligned
        elif isinstance(v, bool):
            sig[a] = "i1"
        elif isinstance(v, float):
            sig[a] = "fp32"
        elif isinstance(v, int):
            sig[a] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0 and v != 0:
                div16.append(a)
        elif hasattr(v, "block_shape") and hasattr(v, "base"):  # a host TensorDescriptor (Gluon's: with a layout)
            layout = getattr(v, "layout", None)
            sig[a] = (f"tensordesc<{_SIG_TYPES[v.base.dtype]}{list(v.block_shape)}"
                      f"{'' if layout is None else ',' + str(layout)}>").replace(" ", "")
        else:
            raise TypeError(f"{getattr(fn, '__name__', fn)}: argument {a} of type {type(v).__name__} is not handled")
    consts = {a: (f"tl.{v}" if type(v).__name__ == "dtype" else v) for a, v in kwargs.items()
              if a not in _LAUNCH_OPTIONS and a not in sig}
    desc = {"sig": sig, "consts": consts, "div16": div16, "num_warps": kwargs.get("num_warps", 4),
            "num_stages": kwargs.get("num_stages", 3), "launch_pdl": kwargs.get("launch_pdl", False)}
    if kwargs.get("maxnreg") is not None:  # a warp-specialized Gluon kernel's register budget
        desc["maxnreg"] = kwargs["maxnreg"]
    return desc


def compile_launch(fn, desc: dict, *, capability: int = 90):
    """`triton.compile` of a described launch for CUDA sm_`capability` (Triton's bundled ptxas: no GPU)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {a: (tl.core.dtype(v[3:]) if isinstance(v, str) and v.startswith("tl.") else v)
              for a, v in desc["consts"].items()}
    # a constexpr the launch left out takes its default, as at run time (not a runtime i32: `if FLAG:` on one
    # would compile the branch the real launch drops)
    for p in getattr(fn, "params", ()):
        if p.is_constexpr and p.name not in consts and p.name not in desc["sig"] and p.has_default:
            consts[p.name] = p.default
        elif p.name not in consts and p.name not in desc["sig"] and p.has_default and p.default is None:
            consts[p.name] = None  # an optional pointer left out: the JIT specializes None as a constexpr
    if "num_warps" in fn.arg_names:  # a Gluon kernel's constexpr, given at launch as the launch option
        consts.setdefault("num_warps", desc["num_warps"])
    sig = {a: ("constexpr" if a in consts else desc["sig"].get(a, "i32")) for a in fn.arg_names}
    if type(fn).__name__ == "GluonJITFunction":  # a Gluon kernel: its own AST source
        return compile_gluon_sm90(fn, sig, consts, num_warps=desc["num_warps"], maxnreg=desc.get("maxnreg"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in desc["div16"]}
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": desc["num_warps"], "num_stages": desc["num_stages"],
                                   "launch_pdl": desc["launch_pdl"],
                                   **({"maxnreg": desc["maxnreg"]} if desc.get("maxnreg") else {})})


def sm90_resources(compiled) -> dict[str, int]:
    """Registers a thread, spilled bytes (stack + local) and shared memory of a kernel `triton.compile`d for a CUDA
    target (read from its cubin with Triton's bundled cuobjdump: no GPU needed), and its wgmma / TMA-load counts."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.remove(f.name)
    found = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", usage)
    regs, stack, local = map(int, found.groups()) if found else (-1, -1, -1)
    ptx = compiled.asm["ptx"]
    return {"registers": regs, "spill_bytes": stack + local, "shared": compiled.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "tma_loads": ptx.count("cp.async.bulk.tensor"),
            "waits_before_reads": ptx_waits_before_reads(ptx)}


def ptx_waits_before_reads(ptx: str) -> bool | None:
    """Whether a kernel's PTX executes `griddepcontrol.wait` before its first global-memory read (ld.global,
    cp.async, a TMA load, an atomic): the contract of a kernel launched with programmatic dependent launch, which may
    start before the previous kernel's writes are visible. None without a griddepcontrol.wait."""
    import re

    wait = ptx.find("griddepcontrol.wait")
    if wait < 0:
        return None
    reads = [m.start() for m in re.finditer(r"\b(ld\.global|cp\.async|atom\.global|red\.global)", ptx)]
    return not reads or wait < min(reads)


def sm90_build_in_subprocess(script: str, arg: Any, *, timeout: float = 600) -> dict:
    """Run a compile-test `script` (`python -c script json(arg)`) in a fresh process without TRITON_INTERPRET (sm_90
    builds need the real NVIDIA backend, not the interpreter the CPU tier runs under), with this checkout first on
    the path; the JSON object on its last line of output. AssertionError with the tail of stderr when it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", script, json.dumps(arg)], capture_output=True, text=True, env=env,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def compile_gluon_sm90(fn, signature: dict[str, str], constexprs: dict[str, Any], *, num_warps: int = 4,
                       maxnreg: int | None = None, div16: tuple[str, ...] = ()):
    """`triton.compile` of a Gluon kernel for sm_90 from the CPU (it cannot run in the interpreter): `signature`
    maps every argument to its type string ("*fp32", "i32", "tensordesc<fp8e4nv[64, 128],NVMMASharedLayout(...)>"),
    constexpr arguments to "constexpr" with their values in `constexprs`; `maxnreg` as the launch passes it (the
    warp-specialized kernels); `div16`: the arguments a launch would specialize as multiples of 16 (integers) or
    16-byte aligned (pointers), as Triton's JIT does from their values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    options = {"num_warps": num_warps} | ({"maxnreg": maxnreg} if maxnreg is not None else {})
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in div16}
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)
