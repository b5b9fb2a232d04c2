"""Fixtures for the in-process PyTorch producer: a fresh bus and an attachment torn down after."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainscope.producers.torch import api
from trainscope.producers.torch.runtime import Attachment
from trainscope.transport.memory import MemoryBus

# The helper module next to this file is imported by the tests as a top-level module.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def memory_bus() -> MemoryBus:
    return MemoryBus()


@pytest.fixture
def attach(memory_bus: MemoryBus) -> Iterator[Callable[..., Attachment]]:
    made: list[Attachment] = []

    def _attach(**options: Any) -> Attachment:
        options.setdefault("bus", memory_bus)
        options.setdefault("job_id", "test-job")
        options.setdefault("window_s", 1.0)
        att = api.attach(**options)
        assert att is not None
        made.append(att)
        return att

    yield _attach
    for att in made:
        att.detach()
    assert api.current() is None


@pytest.fixture
def gloo_group(tmp_path: Path) -> Iterator[None]:
    """A one-process gloo group (world size 1), destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
