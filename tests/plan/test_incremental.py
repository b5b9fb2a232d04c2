"""Incremental placement scoring: after any sequence of swaps, the parts it keeps add up to what
the full latency model scores from scratch; and the search built on it chooses placements at
least as good as the from-scratch search did."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trainscope.plan.costs import stage_costs
from trainscope.plan.incremental import IncrementalScore
from trainscope.plan.latency import LatencyModel, default_slots
from trainscope.plan.recommend import plan
from trainscope.plan.search import anneal, patience, search
from trainscope.plan.spec import ClusterSpec, GpuLink, HostLink, Links, ModelSpec, SearchSpec
from trainscope.plan.transformer import ParallelConfig

MODEL = ModelSpec(layers=24, hidden=2048, heads=16, seq_len=1024, vocab=32000, global_batch=64,
                  precision="mixed")


def latency_model(hosts: int, per_host: int, dp: int, pp: int, tp: int, seed: int,
                  slow: int, caps: int) -> LatencyModel:
    """A cluster with ``slow`` random slow host pairs and ``caps`` degraded GPU NICs."""
    rng = np.random.default_rng(seed)
    pairs = list(itertools.combinations(range(hosts), 2))
    chosen = rng.choice(len(pairs), size=min(slow, len(pairs)), replace=False)
    links = tuple(HostLink(pairs[i], float(rng.choice([5.0, 12.0, 25.0]))) for i in chosen)
    gpu_links = tuple(GpuLink(int(rng.integers(hosts)), int(rng.integers(per_host)),
                              float(rng.choice([20.0, 50.0]))) for _ in range(caps))
    cluster = ClusterSpec(hosts=hosts, gpus_per_host=per_host, gpu_memory_gib=80,
                          peak_tflops=300, links=links, gpu_links=gpu_links)
    cfg = ParallelConfig(dp, pp, tp, 1)
    assert cfg.problem(MODEL, per_host) is None
    return LatencyModel(cfg, stage_costs(MODEL, cluster, cfg), Links.of(cluster),
                        cfg.microbatches(MODEL))


# (hosts, gpus per host, dp, pp, tp, slow host pairs, degraded NICs): small ones including the
# edge shapes (one replica, one stage, one group per host), and medium ones of 64 and 256 GPUs.
CASES = {
    "8x1-dp2pp4": (8, 1, 2, 4, 1, 3, 0),
    "4x2-dp1pp8": (4, 2, 1, 8, 1, 2, 1),
    "4x2-dp8pp1": (4, 2, 8, 1, 1, 2, 1),
    "2x4-dp2pp2tp2": (2, 4, 2, 2, 2, 1, 1),
    "3x2-dp2pp3": (3, 2, 2, 3, 1, 2, 0),
    "8x8-dp4pp4tp4": (8, 8, 4, 4, 4, 3, 2),
    "8x8-dp8pp8": (8, 8, 8, 8, 1, 6, 4),
    "32x8-dp16pp4tp4": (32, 8, 16, 4, 4, 12, 6),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_incremental_score_equals_the_full_score_after_random_swaps(case: str,
                                                                    seed: int) -> None:
    model = latency_model(*CASES[case][:5], seed=seed, slow=CASES[case][5], caps=CASES[case][6])
    groups = model.cfg.dp * model.cfg.pp
    rng = np.random.default_rng(100 + seed)
    start = rng.permutation(groups).reshape(model.cfg.dp, model.cfg.pp)
    score = IncrementalScore(model, start)
    assert score.total == pytest.approx(float(model.step_s(start)), rel=1e-12)
    placement = start.copy()
    for _ in range(150):
        a, b = (int(x) for x in rng.integers(0, groups, 2))
        proposed = score.propose(a, b)
        swapped = placement.copy().reshape(-1)
        swapped[a], swapped[b] = swapped[b], swapped[a]
        assert proposed == pytest.approx(float(model.step_s(swapped.reshape(placement.shape))),
                                         rel=1e-9)
        if rng.random() < 0.5:
            score.accept()
            placement = swapped.reshape(placement.shape)
        else:
            score.reject()
        assert (score.placement() == placement).all()
        assert score.total == pytest.approx(float(model.step_s(placement)), rel=1e-9)
    assert score.rescore() == pytest.approx(score.total, rel=1e-9)


def test_incremental_score_sees_a_slow_link_a_swap_moves_onto_the_critical_path() -> None:
    """The score is not the same number each time: a swap that puts a data-parallel ring edge
    on a 5 Gb/s host pair raises it, the swap back restores it."""
    model = latency_model(8, 1, 2, 4, 1, seed=0, slow=0, caps=0)
    links = model.links
    links.host_bytes_per_s[0, 7] = links.host_bytes_per_s[7, 0] = 5e9 / 8
    slots = np.array([[0, 2, 4, 6], [1, 3, 5, 7]])  # slot = host: no edge uses 0–7
    score = IncrementalScore(model, slots)
    before = score.total
    after = score.propose(4, 7)  # replica 1's stages 0 and 3: stage 0's ring gets edge 0–7
    assert after > 1.05 * before
    assert after == pytest.approx(float(model.step_s(np.array([[0, 2, 4, 6], [7, 3, 5, 1]]))),
                                  rel=1e-12)
    score.accept()
    assert score.propose(4, 7) == pytest.approx(before, rel=1e-12)


@pytest.mark.parametrize("case", ["8x8-dp4pp4tp4", "32x8-dp16pp4tp4"])
def test_the_annealer_ends_where_a_full_rescore_agrees(case: str) -> None:
    model = latency_model(*CASES[case][:5], seed=7, slow=CASES[case][5], caps=CASES[case][6])
    found = anneal(model, seed=1, iterations=3_000)
    # anneal re-scores its best from scratch and raises if the incremental total disagrees.
    assert found.step_s == pytest.approx(float(model.step_s(found.slots)), rel=1e-12)
    assert sorted(found.slots.ravel()) == list(range(model.cfg.dp * model.cfg.pp))
    # Converged: the last patience(groups) proposals (the greedy polish) improved nothing.
    groups = model.cfg.dp * model.cfg.pp
    assert found.proposals >= 3_000 + patience(groups)
    assert 0 < found.last_improved <= found.proposals - patience(groups)


def test_the_search_chooses_at_least_as_well_as_the_from_scratch_search(model7b,
                                                                       cluster64) -> None:
    """The 64-GPU planner case of test_recommend: the recommendation with incremental scoring
    (more proposals in less time) is at least as fast as the from-scratch search's, for the
    same configurations, and the placement it returns scores what it says."""
    model, cluster = model7b(), cluster64()
    links = Links.of(cluster)
    spec = SearchSpec(top_k=3, micro_batch_sizes=(1,))
    before = plan(model, cluster, links, spec, shortlist=3, scoring="full")
    after = plan(model, cluster, links, spec, shortlist=3)
    assert after.ranked[0].step_s <= before.ranked[0].step_s * (1 + 1e-9)
    by_cfg = {c.cfg: c.step_s for c in before.ranked}
    for c in after.ranked:
        assert c.cfg in by_cfg
        assert c.step_s <= by_cfg[c.cfg] * (1 + 1e-9)
        full = LatencyModel(c.cfg, stage_costs(model, cluster, c.cfg), links,
                            c.cfg.microbatches(model))
        assert float(full.step_s(c.slots)) == pytest.approx(c.step_s, rel=1e-12)
    # Searching did something on this cluster: the default placement is beaten.
    assert after.ranked[0].step_s < 0.99 * after.ranked[0].default_step_s


def test_unknown_scoring_is_refused() -> None:
    model = latency_model(8, 1, 2, 4, 1, seed=0, slow=1, caps=0)
    with pytest.raises(ValueError, match="scoring 'fast'"):
        search(model, scoring="fast")
    assert (default_slots(model.cfg) >= 0).all()
