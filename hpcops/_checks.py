"""Argument checks shared by the launchers: each failure names the argument and what is supported."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

from hpcops import _platform


def is_interpreter() -> bool:
    """`_platform.is_interpreter()`, looked up at each call: a module that bound the function itself while
    a test patched `_platform.is_interpreter` would keep the patched one after the test."""
    return _platform.is_interpreter()


FP8_E4M3 = torch.float8_e4m3fn
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None, ndim: int | None = None,
                 shape: tuple | None = None, device: torch.device | None = None) -> None:
    """Raise TypeError/ValueError naming `name` when `t` is not a tensor of the expected kind.

    `shape` entries may be None (any size).
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


_REPLACED = {"depth": 0}  # nesting depth of kernels_replaced()


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """Raise ValueError naming `name` when the Triton kernels cannot run on `t`'s device: a CUDA device,
    or any device (the CPU) when they run through Triton's interpreter (TRITON_INTERPRET=1). The
    launchers' validation calls it on their main tensor, so a CPU tensor gets this error instead of
    Triton's "0 active drivers"."""
    if t.device.type == "cuda" or is_interpreter() or _REPLACED["depth"] or is_fake(t):
        return
    raise ValueError(f"{name} is on {t.device}, but hpcops kernels need a CUDA device; to run them on the CPU "
                     "through Triton's interpreter, set TRITON_INTERPRET=1 before importing hpcops")


@contextlib.contextmanager
def kernels_replaced() -> Iterator[None]:
    """For tools that replace the kernels by stand-ins that launch nothing (hpcops.testing.recorded_launches,
    scripts/ptx_fingerprint.py): within the block `check_kernel_device` accepts any device, and checks of
    what kernels compute (a plan's tables) are skipped (`kernels_are_replaced`)."""
    _REPLACED["depth"] += 1
    try:
        yield
    finally:
        _REPLACED["depth"] -= 1


def kernels_are_replaced() -> bool:
    """Inside `kernels_replaced()`: kernel outputs (a plan's tables) hold nothing to check."""
    return _REPLACED["depth"] > 0


def check_scale(name: str, t, *, device: torch.device | None = None) -> None:
    """A per-tensor scale: fp32 tensor with one element."""
    check_tensor(name, t, dtypes=(torch.float32,), device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must be a one-element float32 tensor (per-tensor scale), got shape {list(t.shape)}")


def check_choice(name: str, value, choices: Iterable) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def checking_enabled() -> bool:
    """Opt-in validation that needs a device sync (values of device tensors): env HPCOPS_CHECK=1.

    Without it, checks of device-tensor values run only where the values are on the host; the
    kernels still bound every index they read from metadata (block ids, slots, positions, expert
    ids), so bad values give a wrong result, never an access outside the tensors.
    """
    return os.environ.get("HPCOPS_CHECK", "0") not in ("", "0")


def values_checkable(t: torch.Tensor) -> bool:
    """Whether to check the values of metadata tensor `t`: always when it is on the host; on a device
    in checking mode (HPCOPS_CHECK=1) only, and never while a CUDA graph is being captured (the check
    copies the values to the host)."""
    if is_fake(t):  # tracing (torch.compile, opcheck): no values to look at
        return False
    if t.device.type == "cpu":
        return True
    return checking_enabled() and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_index_range(name: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Every value of `t` (a host copy is made) lies in [lo, hi); the error names the first offender."""
    v = t.detach().reshape(-1).cpu().long()
    bad = (v < lo) | (v >= hi)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{i}] = {int(v[i])} is outside [{lo}, {hi}) ({what})")


def check_block_table_values(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                             num_blocks: int) -> None:
    """The pages each request uses (the first ceil(seq_len / block_size) entries of its block_table row)
    are block ids of the cache, in [0, num_blocks). `seq_lens`: the lengths, any device."""
    sl = seq_lens.detach().cpu().long()
    if not sl.numel():
        return
    bt = block_table[: sl.numel()].detach().cpu().long()
    used = torch.arange(bt.shape[1])[None, :] < ((sl + block_size - 1) // block_size)[:, None]
    bad = used & ((bt < 0) | (bt >= num_blocks))
    if bool(bad.any()):
        b, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_table[{b}, {col}] = {int(bt[b, col])} is not a block of the cache "
                         f"(0 ≤ id < {num_blocks}); request {b} uses its first "
                         f"{int((sl[b] + block_size - 1) // block_size)} entries")
