"""A plain streaming copy, the bandwidth reference of the benchmarks. Only @triton.jit code."""

import triton
import triton.language as tl


@triton.jit
def stream_copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Grid-stride copy of n fp32 values, BLOCK per step (16-byte vector accesses)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    for start in range(0, n, step):
        idx = start + offs
        mask = idx < n
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)
