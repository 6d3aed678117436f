"""Argument checks shared by the launchers: each failure names the argument and what is supported."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

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
    kernels still mask every access, so bad values cannot cause an illegal memory access.
    """
    return os.environ.get("HPCOPS_CHECK", "0") not in ("", "0")
