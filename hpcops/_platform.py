"""Device facts with CPU fallbacks, so launchers never touch the driver under the interpreter."""

from __future__ import annotations

import functools
import os

import torch

# Number of SMs assumed when no GPU is present (an H200 has 132). Plans computed on the CPU
# (`hpcops demo`, the CPU test tier) use it so that they match what the H200 would run.
DEFAULT_NUM_SMS = 132


def is_interpreter() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of `device`; `DEFAULT_NUM_SMS` on the CPU or under the interpreter."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not is_interpreter():
            return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return DEFAULT_NUM_SMS
    if torch.cuda.is_available() and not is_interpreter():
        return _cuda_sm_count(torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def device_name(device: torch.device | str | None = None) -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu"
