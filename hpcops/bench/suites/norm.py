"""Bench suite `norm`: RMSNorm over model-width rows, alone and with the residual add before it (vLLM's
`rms_norm` and `fused_add_rms_norm`, one CUDA kernel each), at decode and prefill token counts.

Rows, timed as CUDA-graph replays of every layer's call (each layer its own rows, L2-cold):
- `hpcops`: `hpcops.norm.rms_norm`, one launch;
- `torch-fp32`: the sequence the `layer` bench's shared steps run today (`F.rms_norm` of the rows cast to fp32 with
  an fp32 weight, cast back; the residual added first by a torch add): a chain of small launches in a graph;
- `torch`: `F.rms_norm` on the 16-bit rows directly.
`bytes`: the rows read (and the residual) and the outputs written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from hpcops.bench.registry import Case, Impl

HIDDEN = (4096, 7168)  # Hy3; DeepSeek-V3
TOKENS = (1, 4, 64, 256, 2048, 8192)
QUICK_TOKENS = (4, 2048)
EPS = 1e-5


def _make_inputs(t: int, h: int, layer: int, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * layer + t)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    r = torch.randn(t, h, generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16).to(device)
    return {"x": x, "r": r, "w": w}


def _ours(res: bool):
    def prepare(x):
        from hpcops.norm.rms_norm import rms_norm

        out, h = torch.empty_like(x["x"]), torch.empty_like(x["x"])
        if res:
            return lambda: rms_norm(x["x"], x["w"], EPS, residual=x["r"], out=out, residual_out=h)
        return lambda: rms_norm(x["x"], x["w"], EPS, out=out)
    return prepare


def _torch_fp32(res: bool):
    def prepare(x):
        def run():
            h = x["x"] + x["r"] if res else x["x"]
            y = torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), x["w"].float(), EPS).to(h.dtype)
            return (y, h) if res else y
        return run
    return prepare


def _torch(res: bool):
    def prepare(x):
        def run():
            h = x["x"] + x["r"] if res else x["x"]
            y = torch.nn.functional.rms_norm(h, (h.shape[-1],), x["w"], EPS)
            return (y, h) if res else y
        return run
    return prepare


def _check(res: bool):
    def check(x):
        from hpcops.norm import reference as R
        from hpcops.norm.rms_norm import rms_norm
        from hpcops.testing import assert_close

        kw = {"residual": x["r"]} if res else {}
        got, want = rms_norm(x["x"], x["w"], EPS, **kw), R.rms_norm(x["x"], x["w"], EPS, **kw)
        if res:
            if not torch.equal(got[1], want[1]):
                raise AssertionError("rms_norm: the new residual x + residual differs from the reference")
            got, want = got[0], want[0]
        assert_close(want, got, name="rms_norm")
    return check


def cases(opts: dict[str, Any]) -> Iterator[Case]:
    for h in HIDDEN:
        for res in (False, True):
            for t in QUICK_TOKENS if opts.get("quick") else TOKENS:
                name = f"{'add-' if res else ''}rms-H{h}-T{t}"
                yield Case(
                    suite="norm", name=name,
                    make_inputs=lambda layer, device="cuda", t=t, h=h: _make_inputs(t, h, layer, device),
                    impls=[Impl("hpcops", _ours(res), ours=True),
                           Impl("torch-fp32", _torch_fp32(res), note="the layer bench's torch sequence (fp32 casts)"),
                           Impl("torch", _torch(res), note="F.rms_norm on the bf16 rows")],
                    check=_check(res), bytes=t * h * 2 * (4 if res else 2),
                    params={"H": h, "T": t, "residual": res},
                    command=f"hpcops bench norm --only {name}",
                )
