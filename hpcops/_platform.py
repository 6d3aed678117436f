"""Device facts with CPU fallbacks, so launchers never touch the driver under the interpreter.

torch is imported inside the functions that need it: `import hpcops` reads `is_interpreter()` (to
repair the interpreter, `hpcops/_interpreter.py`) and stays cheap.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Number of SMs assumed when no GPU is present (an H200 has 132). Plans computed on the CPU
# (`hpcops demo`, the CPU test tier) use it so that they match what the H200 would run.
DEFAULT_NUM_SMS = 132

# The values of TRITON_INTERPRET that make Triton 3.6 decorate kernels for its interpreter
# (`triton.knobs.runtime.interpret`, case-insensitive; anything else, "2" or "false" included, is off).
_TRUE = ("1", "true", "on", "yes", "y")


def is_interpreter() -> bool:
    """True when Triton kernels run through the CPU interpreter (TRITON_INTERPRET=1), read the way
    Triton reads it, so hpcops and Triton never disagree about the mode."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUE


@functools.cache
def _cuda_sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device | str) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA `device`, asked once per device."""
    import torch

    device = torch.device(device)
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of `device`; `DEFAULT_NUM_SMS` on the CPU or under the interpreter."""
    import torch

    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and not is_interpreter():
            return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return DEFAULT_NUM_SMS
    if torch.cuda.is_available() and not is_interpreter():
        return _cuda_sm_count(torch.cuda.current_device())
    return DEFAULT_NUM_SMS


def device_name(device: torch.device | str | None = None) -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return "cpu"
