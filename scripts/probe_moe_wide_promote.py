"""Probe (not a tool): the fp8 per-tensor MoE's error promoted (`MoeConfig.fp8_promote` 128: the MMA's
reduced-precision sum joins the fp32 accumulator every 128 products) and not (0: Triton's sm_90 default, one sum over
the whole K loop), against the torch reference; Hy3 TP8 (I 192) and EP8 (I 1536, 24 local experts), static and
dynamic activation scales, batches whose tiles are swap-AB (<= 32 rows) and 64+ rows. Prints a markdown table."""
import sys

import torch

sys.path.insert(0, "tests")
from test_moe import HY3_CFG, _hy3_inputs  # noqa: E402

from hpcops.moe import reference as R  # noqa: E402
from hpcops.moe.configs import get_config  # noqa: E402
from hpcops.moe.fused_moe import fused_moe  # noqa: E402
from hpcops.quant import Fp8PerTensor  # noqa: E402
from hpcops.testing import relative_errors  # noqa: E402

print("| shape | T | scales | tile | fp8_promote=0 max / rms | fp8_promote=128 max / rms |")
print("|---|---:|---|---|---|---|")
for shape, inter, n_local in (("TP8", 192, None), ("EP8", 1536, 24)):
    for T in (128, 512, 2048, 8192):
        torch.manual_seed(0)
        wts, tw, ids, emap, x = _hy3_inputs(T, inter, "fp8_tensor", n_local)
        cfg = get_config(num_tokens=T, inter=inter, quant="fp8_tensor", num_local_experts=n_local,
                         device_name=torch.cuda.get_device_name(), **HY3_CFG)
        for dyn in (False, True):
            quant = Fp8PerTensor(wts.quant.w13_scale, wts.quant.w2_scale) if dyn else wts.quant
            ref = R.fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap)
            cells = []
            for promote in (0, 128):
                got = fused_moe(x, wts.w13, wts.w2, tw, ids, quant=quant, expert_map=emap,
                                config=cfg.with_(fp8_promote=promote))
                mx, rms = relative_errors(ref, got)
                cells.append(f"{mx:.2e} / {rms:.2e}")
            tile = f"{cfg.block_m}x{cfg.block_n} swap{int(cfg.swap_ab)}"
            print(f"| {shape} | {T} | {'dynamic' if dyn else 'static'} | {tile} | {cells[0]} | {cells[1]} |",
                  flush=True)
