"""The recommendation on the 64-GPU cluster with slow links, checked on the event replay."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pandas", reason="the what-if engine (the reference) needs pandas")

from trainscope.plan.costs import stage_costs
from trainscope.plan.eventsim import simulate_step_s
from trainscope.plan.latency import default_slots
from trainscope.plan.memory import worst_stage
from trainscope.plan.recommend import plan
from trainscope.plan.spec import GIB, Links, SearchSpec


def test_recommendation_beats_the_uniform_link_choice_by_the_margin_it_predicts(
    model7b, cluster64
) -> None:
    model, cluster = model7b(), cluster64()
    links = Links.of(cluster)
    result = plan(model, cluster, links, SearchSpec(top_k=1, micro_batch_sizes=(1, 2)))
    best, uniform = result.ranked[0], result.uniform_choice
    assert uniform is not None and best.slots is not None

    def replay(cfg, slots) -> float:
        costs = stage_costs(model, cluster, cfg)
        return float(np.mean([simulate_step_s(cfg, costs, links, cfg.microbatches(model), slots,
                                              seed=s) for s in range(2)]))

    predicted = uniform.default_step_s / best.step_s
    simulated = replay(uniform.cfg, default_slots(uniform.cfg)) / replay(best.cfg, best.slots)
    assert predicted > 1.03, "the slow links should cost the uniform-link choice something"
    assert simulated == pytest.approx(predicted, rel=0.03)
    # What a uniform-link planner believes and what it gets differ: that is the slow links.
    assert uniform.default_step_s > 1.05 * uniform.uniform_step_s


def test_nothing_recommended_exceeds_memory_and_every_rejection_says_why(model7b,
                                                                         cluster64) -> None:
    model, cluster = model7b(recompute=False), cluster64()
    result = plan(model, cluster, Links.of(cluster), SearchSpec(top_k=10), shortlist=12,
                  iterations=300)
    limit = cluster.gpu_memory_gib * GIB
    assert result.ranked
    for c in result.ranked:
        assert worst_stage(model, c.cfg).total_bytes <= limit
    over = [r for r in result.rejected if "GiB >" in r.reason]
    assert over, "some configurations of a 7B model must not fit in 80 GiB"
    for r in over:
        assert worst_stage(model, r.cfg).total_bytes > limit
        assert r.reason.startswith("stage ")
