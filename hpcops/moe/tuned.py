"""Measured MoE configs per device (`torch.cuda.get_device_name()`), used by `configs.get_config`.

Each entry: {"E", "E_local", "H", "I", "quant", "T", "config": {MoeConfig fields}, ...}; see
`configs.tuned_entry` for the lookup (same shape, nearest measured batch). Produce entries on the device
with `scripts/sweep_moe.py --out DIR` (DIR/moe_sweep.json holds {"device", "entries"}); try them without
editing this file through `HPCOPS_MOE_TUNED=DIR/moe_sweep.json`, then paste the "entries" list here under
the device name. Only measured configs belong here.
"""

from __future__ import annotations

TUNED: dict[str, list[dict]] = {
    # "NVIDIA H200": [ ...entries from scripts/sweep_moe.py... ],
}
