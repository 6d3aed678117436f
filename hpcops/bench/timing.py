"""Timing the way a model runs: several layers, each with its own inputs, in one CUDA graph; and, for
like-for-like comparisons with a peer that can only be timed by its own kernels, the profiler's device
time of the kernels a call launches (`profiler_kernel_time_us`)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from hpcops.testing import capture_graph

L2_BYTES = 60 * 1024 * 1024  # H200 L2; inputs of all layers together should exceed a few times this


def layers_for(bytes_per_layer: int, *, minimum: int = 8, maximum: int = 64, cold_factor: int = 3,
               memory_budget: int = 40 << 30) -> int:
    """Layers per graph: enough that all layers' inputs exceed `cold_factor` × L2, within memory."""
    if bytes_per_layer <= 0:
        return minimum
    want = -(-cold_factor * L2_BYTES // bytes_per_layer)
    fit = max(1, memory_budget // max(bytes_per_layer, 1))
    return int(max(1, min(max(minimum, want), maximum, fit)))


def graph_time_us(fns: Sequence[Callable[[], object]], *, replays: int = 50, warmup: int = 3,
                  window: list[tuple[float, float]] | None = None) -> float:
    """Median replay time of one CUDA graph holding every `fn` in order, divided by len(fns), in µs. `window`: the
    timed replays' (start, end) in `time.monotonic()` seconds is appended to it (the SM clock's window,
    `hpcops.bench.clock`: the capture and the warm-up replays are left out)."""
    graph, _ = capture_graph(lambda: [fn() for fn in fns])
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.monotonic()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    if window is not None:
        window.append((t0, time.monotonic()))
    times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    del graph
    return statistics.median(times) / len(fns)


def eager_time_us(fn: Callable[[], object], *, replays: int = 50, warmup: int = 3,
                  before: Callable[[], object] | None = None) -> float:
    """Median time of `fn` launched eagerly (for steps that run once per decode step), in µs. `before`: run ahead of
    each timed launch, outside its events (e.g. an L2 flush)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


# The marker launched between profiled calls: a kernel no implementation launches (hpcops' own copy kernel)
MARKER_KERNEL = "stream_copy_kernel"


def profiler_kernel_time_us(fns: Sequence[Callable[[], object]], kernel_filter: str | tuple[str, ...] | None = None, *,
                            calls: int = 5, warmup: int = 1, window: list[tuple[float, float]] | None = None) -> float:
    """Median per-call device time of the kernels a call launches, in µs, from torch.profiler (CUDA activity).

    Runs every `fn` (one per layer, each with its own inputs, so L2 is as cold as in `graph_time_us`)
    `calls` times in layer order, eagerly, a marker kernel before each call and after the last; a call's
    time is the time covered by the device events (kernels, memsets, copies) between its two markers whose
    name contains `kernel_filter` (or one of its texts; every one if None): the sum of their durations, where two
    overlap (a kernel launched with programmatic dependent launch starts before the previous one ends) the overlap
    once. Launch
    gaps and host work are not counted: this is the GPU time of the kernels only, the same for hpcops and for a
    peer. `window`: as `graph_time_us`'s (warm-up and profiled calls).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from hpcops.bench._copy_kernels import stream_copy_kernel

    src = torch.zeros(128, device="cuda")
    dst = torch.empty_like(src)
    marker = lambda: stream_copy_kernel[(1,)](src, dst, src.numel(), BLOCK=128)
    t0 = time.monotonic()
    us = profile_per_call_us(fns, kernel_filter, calls=calls, warmup=warmup, marker=marker,
                             marker_name=MARKER_KERNEL, activity=ProfilerActivity.CUDA,
                             device_type=DeviceType.CUDA, sync=torch.cuda.synchronize)
    if window is not None:
        window.append((t0, time.monotonic()))
    return us


def profile_per_call_us(fns: Sequence[Callable[[], object]], name_filter: str | tuple[str, ...] | None, *, calls: int,
                        warmup: int,
                        marker: Callable[[], object], marker_name: str, activity, device_type,
                        sync: Callable[[], None]) -> float:
    """The device-independent body of `profiler_kernel_time_us` (the CPU tests run it with CPU activity)."""
    from torch.profiler import profile

    for _ in range(warmup):  # compiles, allocator growth, lazy init: outside the profile
        for fn in fns:
            fn()
    marker()
    sync()
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            for fn in fns:
                marker()
                fn()
        marker()
        sync()
    events = device_events(prof.events(), device_type)
    return per_call_us(events, name_filter=name_filter, marker=marker_name, calls=calls * len(fns))


def device_events(events: Iterable, device_type) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of the profiler's FunctionEvents on `device_type`, in start order
    (user annotations projected onto the device timeline are ranges, not work: left out)."""
    out = [(e.name, float(e.time_range.start), float(e.time_range.elapsed_us())) for e in events
           if e.device_type == device_type and not getattr(e, "is_user_annotation", False)]
    return sorted(out, key=lambda ev: ev[1])


def per_call_us(events: Sequence[tuple[str, float, float]], *, name_filter: str | tuple[str, ...] | None, marker: str,
                calls: int) -> float:
    """Median over calls of the time covered by the events matching `name_filter` (a text, or a tuple of texts any
    of which matches; all if None) between
    consecutive `marker` events (names matched as substrings; `events` in start order): the union of their
    [start, start + duration) intervals, i.e. their summed durations less any overlap.

    Raises RuntimeError if the markers do not delimit exactly `calls` calls, or if no event matched:
    a wrong count or a filter matching nothing must never read as a time.
    """
    texts = (name_filter,) if isinstance(name_filter, str) else name_filter
    sums: list[float] = []
    cur: list[tuple[float, float]] | None = None
    matched = 0
    for name, start, dur in events:
        if marker in name:
            if cur is not None:
                sums.append(_covered(cur))
            cur = []
        elif cur is not None and (texts is None or any(t in name for t in texts)):
            cur.append((start, start + dur))
            matched += 1
    if len(sums) != calls:
        raise RuntimeError(f"profiler: the {marker!r} markers delimit {len(sums)} calls, expected {calls} "
                           "(events dropped?)")
    if matched == 0:
        what = f"named {' or '.join(f'*{t}*' for t in texts)}" if texts is not None else "at all"
        raise RuntimeError(f"profiler: no device events {what} between the markers")
    return statistics.median(sums)


def _covered(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals given in start order."""
    total, end = 0.0, float("-inf")
    for a, b in intervals:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> dict[str, float]:
    """Measured device-to-device copy bandwidth (bytes read + written per second), in GB/s.

    A 1 GiB fp32 tensor copied into another, median of graph replays, two ways: torch's `copy_`
    (which a graph may record as a copy-engine memcpy) and a streaming Triton kernel on the SMs
    (4 programs per SM, 16-byte accesses). The benchmarks use the larger as the reference.
    """
    from hpcops._platform import num_sms
    from hpcops.bench._copy_kernels import stream_copy_kernel

    src = torch.randn(nbytes // 8, device="cuda")
    dst = torch.empty_like(src)
    n = src.numel()
    grid = (4 * num_sms(src.device),)
    triton_copy = lambda: stream_copy_kernel[grid](src, dst, n, BLOCK=4096, num_warps=8)
    for _ in range(100):  # ~0.2 s of load first: an idle H200 sits at low clocks (seen: 345 MHz)
        dst.copy_(src)
        triton_copy()
    moved = 2 * n * src.element_size()
    t_torch = min(graph_time_us([lambda: dst.copy_(src)], replays=20) for _ in range(3))
    t_triton = min(graph_time_us([triton_copy], replays=20) for _ in range(3))
    return {"torch": moved / (t_torch * 1e-6) / 1e9, "triton": moved / (t_triton * 1e-6) / 1e9}


def gemm_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Measured dense GEMM throughput through torch (the compute ceiling), in TFLOP/s."""
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        bt = b.t().contiguous().t()
        fn = lambda: torch._scaled_mm(a, bt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        fn = lambda: a @ b
    t = eager_time_us(fn, replays=10)
    return 2 * n**3 / (t * 1e-6) / 1e12
