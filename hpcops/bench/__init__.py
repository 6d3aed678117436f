"""`hpcops bench`: scenario registry, CUDA-graph timing, correctness gate, reports."""

from hpcops.bench.registry import SUITES, Case, Impl, PeerUnavailable, get_suite
from hpcops.bench.runner import run_suite

__all__ = ["Case", "Impl", "PeerUnavailable", "SUITES", "get_suite", "run_suite"]
