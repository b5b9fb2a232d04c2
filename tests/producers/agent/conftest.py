"""Fixtures for the host-agent tests: stand-in CUDA/NCCL libraries built with gcc."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import fakecuda


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> fakecuda.FakeCuda:
    if not fakecuda.gcc_available():
        pytest.fail("gcc is required to build the stand-in CUDA/NCCL libraries for the eBPF tests")
    return fakecuda.build(tmp_path_factory.mktemp("fakecuda"))
