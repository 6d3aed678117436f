"""Measured MoE configs per device (`torch.cuda.get_device_name()`), used by `configs.get_config`.

Each entry: {"E", "E_local", "H", "I", "quant", "T", "config": {MoeConfig fields}, ...}; see
`configs.tuned_entry` for the lookup (same shape, nearest measured batch). Produced on the device by
`hpcops tune moe --out DIR` (DIR/moe_tuned.json holds {"device", "entries", "measured"}); try them without
editing this file through `HPCOPS_MOE_TUNED=DIR/moe_tuned.json`, then merge them here with
`hpcops tune moe --merge DIR/moe_tuned.json` (or `--write` in the tuning run), which rewrites the literal
below (sorted; the measured batches of that device replaced). Only measured configs belong here.
"""

from __future__ import annotations

TUNED: dict[str, list[dict]] = {
}
