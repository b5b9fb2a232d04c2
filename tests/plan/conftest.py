"""Shared clusters and models of the planner tests (as factory fixtures)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from trainscope.plan.spec import ClusterSpec, HostLink, ModelSpec

# A 64-GPU cluster (8 hosts × 8) with three deliberately slow host-to-host links.
SLOW_LINKS = (HostLink((0, 3), 12.0), HostLink((2, 5), 12.0), HostLink((6, 7), 25.0))


@pytest.fixture
def cluster64() -> Callable[..., ClusterSpec]:
    def make(links: tuple[HostLink, ...] = SLOW_LINKS) -> ClusterSpec:
        return ClusterSpec(hosts=8, gpus_per_host=8, gpu_memory_gib=80, peak_tflops=989,
                           inter_host_gbit_per_s=200, links=links)

    return make


@pytest.fixture
def model7b() -> Callable[..., ModelSpec]:
    def make(**kw: object) -> ModelSpec:
        base: dict[str, object] = dict(layers=32, hidden=4096, heads=32, seq_len=2048,
                                       vocab=50304, global_batch=256, precision="mixed")
        base.update(kw)
        return ModelSpec(**base)  # type: ignore[arg-type]

    return make
