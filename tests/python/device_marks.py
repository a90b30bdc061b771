"""What this machine can run, for the tests of several folders: the CPU ISA builds of
vpage._core, and the ``cuda`` mark for tests that need an NVIDIA GPU and vpage._cuda."""

from __future__ import annotations

import pytest
import torch

from vpage import _core

try:
    from vpage import _cuda
except ImportError:
    _cuda = None


def available_isas() -> list[str]:
    """The CPU ISA builds of vpage._core this machine can run (``_core.set_cpu_isa`` names)."""
    isas = []
    for isa in ("generic", "avx2", "avx2vnni", "avx512", "avx512vnni"):
        try:
            _core.set_cpu_isa(isa)
            isas.append(isa)
        except ValueError:
            pass
    _core.set_cpu_isa("auto")
    return isas


def cuda_ready() -> bool:
    return torch.cuda.is_available() and _cuda is not None and _cuda.is_available()


def requires_cuda(test):
    """Marks `test` as a CUDA test, skipped where there is no GPU or no vpage._cuda."""
    skip = pytest.mark.skipif(not cuda_ready(), reason="needs an NVIDIA GPU and vpage._cuda")
    return pytest.mark.cuda(skip(test))
