"""Test tiers. Without a CUDA device the kernels run through Triton's interpreter (CPU tier, CI),
with our fidelity repairs installed; `@pytest.mark.gpu` tests run only where CUDA is present."""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton kernels

sys.path.insert(0, os.path.dirname(__file__))
import interp_fidelity  # noqa: E402

if not HAS_CUDA:
    interp_fidelity.install()

DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (GPU tier: scripts/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
