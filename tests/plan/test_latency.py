"""The latency model against the event-level replay of the same placed jobs.

The replay (:mod:`trainscope.plan.eventsim`) runs the what-if engine's discrete-event simulator
on the Megatron 1F1B dependency graph, with every op's time from its own ranks' links and noisy
compute; the model is a closed-form critical path. 40 configurations and placements of a
64-GPU cluster with three slow links.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

pytest.importorskip("pandas", reason="the what-if engine (the reference) needs pandas")

from trainscope.plan.costs import stage_costs
from trainscope.plan.eventsim import simulate_step_s
from trainscope.plan.latency import LatencyModel, default_slots
from trainscope.plan.spec import Links
from trainscope.plan.transformer import ParallelConfig

SHAPES = [(8, 4, 2), (4, 4, 4), (2, 4, 8), (4, 8, 2), (8, 8, 1), (2, 8, 4), (16, 2, 2),
          (4, 2, 8), (8, 2, 4), (2, 16, 2)]


def pairs(model, cluster) -> list[tuple[float, float]]:
    links = Links.of(cluster)
    rng = np.random.default_rng(7)
    out = []
    for dp, pp, tp in SHAPES:
        for micro_batch in (1, 2):
            cfg = ParallelConfig(dp, pp, tp, micro_batch)
            assert cfg.problem(model, cluster.gpus_per_host) is None
            m = cfg.microbatches(model)
            costs = stage_costs(model, cluster, cfg)
            latency = LatencyModel(cfg, costs, links, m)
            for k in range(2):  # Megatron's default placement, then a random one
                slots = (default_slots(cfg) if k == 0
                         else rng.permutation(dp * pp).reshape(dp, pp))
                predicted = float(latency.step_s(slots))
                simulated = simulate_step_s(cfg, costs, links, m, slots, seed=k)
                out.append((predicted, simulated))
    return out


def test_model_matches_the_replay_on_a_64_gpu_cluster_with_slow_links(model7b, cluster64) -> None:
    got = np.array(pairs(model7b(), cluster64()))
    assert len(got) >= 30
    error = np.abs(got[:, 0] / got[:, 1] - 1)
    rho = spearmanr(got[:, 0], got[:, 1]).statistic
    assert np.median(error) < 0.10, f"median error {np.median(error):.3f}"
    assert rho >= 0.9, f"Spearman {rho:.3f}"
    # The placements really differ: the slow links cost some of them a lot.
    assert got[:, 1].max() > 2 * got[:, 1].min()


def test_a_slow_link_on_the_pipeline_path_shows_in_both(model7b, cluster64) -> None:
    model = model7b()
    cfg = ParallelConfig(1, 8, 8, 1)  # one stage per host, the pipeline crosses every host
    costs = stage_costs(model, cluster64(), cfg)
    m = cfg.microbatches(model)
    slots = default_slots(cfg)
    times = {}
    for name, spec in (("fast", cluster64(links=())), ("slow", cluster64())):
        links = Links.of(spec)
        times[name] = (float(LatencyModel(cfg, costs, links, m).step_s(slots)),
                       simulate_step_s(cfg, costs, links, m, slots))
    # Hosts 6 and 7 are neighbours in the pipeline: their 25 Gb/s link slows every cycle.
    assert times["slow"][0] > 1.05 * times["fast"][0]
    assert times["slow"][1] > 1.05 * times["fast"][1]
