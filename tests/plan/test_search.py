"""Placement search: simulated annealing against the exhaustive optimum on small clusters."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trainscope.plan.costs import stage_costs
from trainscope.plan.latency import LatencyModel, default_slots
from trainscope.plan.search import exhaustive, search
from trainscope.plan.spec import ClusterSpec, HostLink, Links, ModelSpec
from trainscope.plan.transformer import ParallelConfig

MODEL = ModelSpec(layers=24, hidden=2048, heads=16, seq_len=1024, vocab=32000, global_batch=32,
                  precision="mixed")
# (hosts, gpus per host, dp, pp, tp): every shape of ≤ 8 GPUs with at least 4 groups.
SHAPES = [(4, 2, 2, 4, 1), (2, 4, 2, 2, 2), (8, 1, 2, 4, 1), (4, 2, 4, 2, 1), (2, 4, 4, 2, 1),
          (3, 2, 2, 3, 1), (8, 1, 8, 1, 1), (8, 1, 1, 8, 1), (4, 2, 2, 2, 2), (2, 2, 2, 2, 1)]


def instances() -> list[tuple[str, LatencyModel]]:
    rng = np.random.default_rng(11)
    out = []
    for (hosts, per_host, dp, pp, tp), seed in itertools.product(SHAPES, range(2)):
        pairs = list(itertools.combinations(range(hosts), 2))
        chosen = rng.choice(len(pairs), size=min(1 + seed, len(pairs)), replace=False)
        links = tuple(HostLink(pairs[i], float(rng.choice([5.0, 12.0, 25.0]))) for i in chosen)
        cluster = ClusterSpec(hosts=hosts, gpus_per_host=per_host, gpu_memory_gib=80,
                              peak_tflops=300, links=links)
        cfg = ParallelConfig(dp, pp, tp, 1)
        assert cfg.problem(MODEL, per_host) is None
        model = LatencyModel(cfg, stage_costs(MODEL, cluster, cfg), Links.of(cluster),
                             cfg.microbatches(MODEL))
        out.append((f"{hosts}x{per_host}-{cfg.label()}-{seed}", model))
    return out


INSTANCES = instances()


@pytest.mark.parametrize("model", [m for _, m in INSTANCES], ids=[n for n, _ in INSTANCES])
def test_annealing_finds_the_exhaustive_optimum(model: LatencyModel) -> None:
    best = exhaustive(model)
    found = search(model, seed=3)
    assert found.step_s == pytest.approx(best.step_s, rel=1e-9)
    assert float(model.step_s(found.slots)) == pytest.approx(found.step_s, rel=1e-12)
    assert sorted(found.slots.ravel()) == list(range(model.cfg.dp * model.cfg.pp))


def test_the_suite_is_not_trivial() -> None:
    """On most instances the default placement is not optimal: the search has work to do."""
    worse = sum(float(m.step_s(default_slots(m.cfg))) > 1.01 * exhaustive(m).step_s
                for _, m in INSTANCES)
    assert worse >= len(INSTANCES) // 3
