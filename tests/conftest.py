"""Test tiers. Without a CUDA device the kernels run through Triton's interpreter (CPU tier, CI),
with hpcops' interpreter repairs installed (hpcops/_interpreter.py; `import hpcops` installs them,
and the explicit install() below keeps them under HPCOPS_INTERPRETER_REPAIR=0 too: the tests'
tolerances assume them); `@pytest.mark.gpu` tests run only where CUDA is present."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from hpcops._platform import is_interpreter

HAS_CUDA = torch.cuda.is_available() and not is_interpreter()
SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def load_script(name: str, module: str | None = None):
    """scripts/<name>.py imported as module `module` (default: name), registered in sys.modules first (a script's
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(module or name, os.path.join(SCRIPTS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton kernels
    from hpcops import _interpreter

    _interpreter.install()

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


def _shrink_hy3(monkeypatch, suite) -> None:
    """A Hy3 bench suite's model constants at interpreter sizes (E 8, top-3, H 256, I 128; EP8: 3 local)."""
    monkeypatch.setattr(suite, "E_GLOBAL", 8)
    monkeypatch.setattr(suite, "TOP_K", 3)
    monkeypatch.setattr(suite, "HIDDEN", 256)
    monkeypatch.setattr(suite, "INTER", {"tp8": 128, "ep8": 128})
    monkeypatch.setattr(suite, "N_LOCAL", {"tp8": 8, "ep8": 3})


@pytest.fixture
def tiny_moe_suite(monkeypatch):
    """The Hy3 `moe` bench suite shrunk to interpreter sizes (E 8, top-3, H 256, I 128; EP8: 3 local)."""
    from hpcops.bench.suites import moe as suite

    _shrink_hy3(monkeypatch, suite)


@pytest.fixture
def tiny_layer_suite(monkeypatch):
    """The `layer` bench suite (issue 11) at the same sizes, its shared expert's I 64; returns the module."""
    from hpcops.bench.suites import layer as suite

    _shrink_hy3(monkeypatch, suite)
    monkeypatch.setattr(suite, "SHARED_INTER", 64)
    return suite
