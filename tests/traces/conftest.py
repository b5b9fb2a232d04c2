"""Traces written by real torch.profiler runs in the test session, and the recorded H100 ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

import trace_jobs


@pytest.fixture(scope="session")
def gloo_traces(tmp_path_factory) -> Path:
    """Two ranks of a gloo DDP job; rank 1 runs an extra record_function block."""
    from kafka_broker import free_port  # the shared helper that picks a free local port

    out = tmp_path_factory.mktemp("gloo-traces")
    mp.start_processes(trace_jobs.profile_rank, args=(2, free_port(), str(out), 1), nprocs=2,
                       start_method="spawn")
    return out


@pytest.fixture(scope="session")
def handler_trace(tmp_path_factory) -> Path:
    return trace_jobs.profile_single(tmp_path_factory.mktemp("tb"), handler=True)


@pytest.fixture(scope="session")
def plain_trace(tmp_path_factory) -> Path:
    return trace_jobs.profile_single(tmp_path_factory.mktemp("plain"), handler=False)


@pytest.fixture(scope="session")
def slow_data_trace(tmp_path_factory) -> Path:
    """A plain export of a run whose DataLoader takes 8 ms per batch in the training process."""
    return trace_jobs.profile_single(tmp_path_factory.mktemp("slow"), handler=False,
                                     slow_data=True)
