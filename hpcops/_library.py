"""torch.library registration without custom_op's per-call overhead.

Each op is defined once in the ``hpcops`` namespace from a Python function's signature
(`torch.library.infer_schema`), implemented for CPU (the interpreter path) and CUDA by the same
launcher, and given a fake implementation for torch.compile / opcheck. Public functions call the
launchers directly; the registered ops exist for torch.compile and for graph-capturing frameworks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_LIB = torch.library.Library("hpcops", "FRAGMENT")
_DEFINED: dict[str, Callable] = {}


def register(name: str, fn: Callable, *, mutates_args: Sequence[str], fake: Callable) -> Callable:
    """Define ``torch.ops.hpcops.<name>`` backed by `fn` on CPU and CUDA, with `fake` for meta tensors."""
    if name in _DEFINED:
        return getattr(torch.ops.hpcops, name)
    schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
    _LIB.define(name + schema)
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, fn, key)
    torch.library.register_fake(f"hpcops::{name}", fake, lib=_LIB)
    _DEFINED[name] = fn
    return getattr(torch.ops.hpcops, name)
