"""The GPU's SM clock while a row is timed: NVML sampled on a thread (`hpcops bench`'s `SM MHz` column).

Two rows timed side by side can run at different clocks: on an H100 (700 W limit) our bf16 prefill at h64/8 q8k ran
at a median 1590 MHz under the software power cap while the fp8 kernel of the same case ran at ~1750 and every h8/1
row at the full 1980 (`bench/results/probe_prefill_clock_h100_a668bf5.md`). A µs ratio then holds the clocks' ratio;
the bench reports each row's median SM MHz beside its µs so that a reader can tell the two apart.

NVML comes from the `nvidia-ml-py` wheel (`import pynvml`); where it is missing, or there is no GPU, `ClockSampler.
start()` returns None and the rows carry no clock. A sample is (monotonic s, SM MHz, W, clock-event reason bits); the
power reading is NVML's (a one-second average on Hopper), the reasons are NVML's bits (0x4: the software power cap,
0x20 / 0x40: thermal slowdown, 0x1: idle).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable, Sequence

Sample = tuple[float, float, float, int]


def summarize(samples: Sequence[Sample], windows: Iterable[tuple[float, float]]) -> dict:
    """The samples that fall in any of `windows` ((start, end) monotonic seconds): their count, median / lowest /
    highest SM MHz, mean W and the union of their reason bits as hex; {"samples": 0} where none falls in."""
    spans = list(windows)
    picked = [s for s in samples if any(t0 <= s[0] <= t1 for t0, t1 in spans)]
    if not picked:
        return {"samples": 0}
    mhz = [s[1] for s in picked]
    reasons = 0
    for s in picked:
        reasons |= int(s[3])
    return {"samples": len(picked), "mhz_median": statistics.median(mhz), "mhz_min": min(mhz), "mhz_max": max(mhz),
            "watts_mean": statistics.fmean(s[2] for s in picked), "reasons": hex(reasons)}


class ClockSampler:
    """NVML samples of GPU `index` every `period` seconds on a daemon thread, from `start()` to `stop()`."""

    def __init__(self, nvml, handle, period: float = 0.002):
        self._nvml, self._handle, self.period = nvml, handle, period
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcops-clock", daemon=True)

    @classmethod
    def start(cls, index: int | None = None, period: float = 0.002) -> ClockSampler | None:
        """A running sampler of CUDA device `index` (default: the current one), or None without a GPU or NVML."""
        try:
            import pynvml
            import torch

            if not torch.cuda.is_available():
                return None
            pynvml.nvmlInit()
            cuda_index = torch.cuda.current_device() if index is None else index
            try:  # NVML counts every GPU; CUDA only the visible ones (CUDA_VISIBLE_DEVICES): torch maps the two
                nvml_index = torch.cuda._get_nvml_device_index(cuda_index)
            except Exception:
                nvml_index = cuda_index
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
        except Exception:  # no wheel, no driver library, no device: the rows go without a clock
            return None
        sampler = cls(pynvml, handle, period)
        sampler._thread.start()
        return sampler

    def _run(self) -> None:
        n, h = self._nvml, self._handle
        reasons = (getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or n.nvmlDeviceGetCurrentClocksThrottleReasons)
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), float(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                                     n.nvmlDeviceGetPowerUsage(h) / 1e3, int(reasons(h))))
            except Exception:  # a failing query ends the sampling, never the run
                return
            time.sleep(self.period)

    def window(self, *windows: tuple[float, float]) -> dict:
        """`summarize` of the samples so far over `windows`."""
        return summarize(list(self.samples), windows)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
