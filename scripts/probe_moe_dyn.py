"""Probe (not a tool): Hy3 TP8 fused_moe with dynamic per-token fp8 activations, T = 64, swap-AB on and off,
against the torch reference and against each other; which config knob moves the error."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe import HY3_CFG, _hy3_inputs  # noqa: E402

from hpcops.moe import reference as R  # noqa: E402
from hpcops.moe.configs import get_config  # noqa: E402
from hpcops.moe.fused_moe import fused_moe  # noqa: E402
from hpcops.quant import Fp8PerTensor  # noqa: E402
from hpcops.testing import relative_errors  # noqa: E402

for T in (4, 16, 64, 256):
    torch.manual_seed(0)
    wts, tw, ids, emap, x = _hy3_inputs(T, 192, "fp8_tensor")
    for dyn in (True, False):
        quant = Fp8PerTensor(wts.quant.w13_scale, wts.quant.w2_scale) if dyn else wts.quant
        ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant)
        base = get_config(num_tokens=T, inter=192, quant="fp8_tensor", **HY3_CFG)
        outs = {}
        for name, kw in (("default", {}), ("swap0", dict(swap_ab=False)), ("swap1", dict(swap_ab=True)),
                         ("swap1-dbn64", dict(swap_ab=True, down_block_n=64)),
                         ("swap1-dbk128", dict(swap_ab=True, down_block_k=128)),
                         ("swap1-bk256", dict(swap_ab=True, block_k=256)),
                         ("swap1-noprequant", dict(swap_ab=True, prequant_x=False)),
                         ("swap1-bn64", dict(swap_ab=True, block_n=64)),
                         ("swap1-st2", dict(swap_ab=True, num_stages=2, down_num_stages=2)),
                         ("swap1-bm32", dict(swap_ab=True, block_m=32, naive_max_pairs=0))):
            cfg = base.with_(**kw)
            got = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, config=cfg)
            outs[name] = got
            mx, rms = relative_errors(ref, got)
            print(f"T{T} {'dyn' if dyn else 'static'} {name:18s} max {mx:.3e} rms {rms:.3e}")
        mx, rms = relative_errors(outs["swap0"], outs["swap1"])
        print(f"T{T} {'dyn' if dyn else 'static'} swap1 vs swap0  max {mx:.3e} rms {rms:.3e}")
        d = (outs["swap1"].float() - outs["swap0"].float()).abs().amax(-1)
        print("   tokens with the largest swap1-swap0 difference:", d.topk(min(5, T)).indices.tolist(),
              [round(v, 3) for v in d.topk(min(5, T)).values.tolist()])
