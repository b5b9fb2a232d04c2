"""Configuration what-if (`trainscope plan`): accuracy of the latency model, the gain of the
recommendation on a cluster with slow links, and search time against cluster size, on one core.

1. **Model vs replay**: 60 configurations and placements (Megatron's, a random one and one the
   search picked, for 20 configurations) of a 64-GPU cluster (8 hosts × 8) with three slow
   host-to-host links; the latency model's step time against the what-if engine's
   event replay of the same placed job (trainscope.plan.eventsim). Median error and Spearman ρ.
2. **Recommendation vs uniform links**: the recommendation (configuration + searched placement
   on the measured links) against what a planner assuming uniform links would run (its best
   configuration, Megatron's placement), both scored by the model (the predicted margin) and by
   the replay (the simulated margin).
3. **Search time**: the whole `plan()` (enumerate, memory, score every configuration, anneal the
   8 most promising) for 64, 512 and 4,096 GPUs, in CPU seconds, with the number of model
   evaluations; the same-run baseline is the CPU time of scoring every candidate configuration
   once with the default placement (the work of a planner without placement search).

    python benchmarks/bench_plan.py            # all three parts
    python benchmarks/bench_plan.py --quick    # 64 and 512 GPUs only
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from trainscope.plan.costs import stage_costs  # noqa: E402
from trainscope.plan.eventsim import simulate_step_s  # noqa: E402
from trainscope.plan.incremental import IncrementalScore  # noqa: E402
from trainscope.plan.latency import LatencyModel, default_slots  # noqa: E402
from trainscope.plan.recommend import configurations, memory_problem, plan  # noqa: E402
from trainscope.plan.search import anneal, default_iterations, search  # noqa: E402
from trainscope.plan.spec import (  # noqa: E402
    GBIT,
    ClusterSpec,
    HostLink,
    Links,
    ModelSpec,
    SearchSpec,
)
from trainscope.plan.transformer import ParallelConfig  # noqa: E402

MODEL_7B = ModelSpec(layers=32, hidden=4096, heads=32, seq_len=2048, vocab=50304,
                     global_batch=256, precision="mixed")
MODEL_70B = ModelSpec(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=128256,
                      global_batch=1024, precision="mixed", recompute=True)
SLOW_3 = (HostLink((0, 3), 12.0), HostLink((2, 5), 12.0), HostLink((6, 7), 25.0))


def cluster(hosts: int, slow: tuple[HostLink, ...]) -> ClusterSpec:
    return ClusterSpec(hosts=hosts, gpus_per_host=8, gpu_memory_gib=80, peak_tflops=989,
                       inter_host_gbit_per_s=200, links=slow)


def random_slow(hosts: int, count: int, seed: int) -> tuple[HostLink, ...]:
    rng = np.random.default_rng(seed)
    pairs = set()
    while len(pairs) < count:
        a, b = sorted(int(x) for x in rng.choice(hosts, 2, replace=False))
        pairs.add((a, b))
    return tuple(HostLink(p, float(rng.choice([12.0, 25.0, 50.0]))) for p in sorted(pairs))


def model_vs_replay() -> None:
    spec = cluster(8, SLOW_3)
    links = Links.of(spec)
    rng = np.random.default_rng(7)
    rows = []
    shapes = [(8, 4, 2), (4, 4, 4), (2, 4, 8), (4, 8, 2), (8, 8, 1), (2, 8, 4), (16, 2, 2),
              (4, 2, 8), (8, 2, 4), (2, 16, 2)]
    for (dp, pp, tp), mb in itertools.product(shapes, (1, 2)):
        cfg = ParallelConfig(dp, pp, tp, mb)
        costs = stage_costs(MODEL_7B, spec, cfg)
        m = cfg.microbatches(MODEL_7B)
        latency = LatencyModel(cfg, costs, links, m)
        random = rng.permutation(dp * pp).reshape(dp, pp)
        searched = search(latency, restarts=0, iterations=500, seed=mb).slots
        for k, slots in enumerate((default_slots(cfg), random, searched)):
            predicted = float(latency.step_s(slots))
            rows.append((predicted, simulate_step_s(cfg, costs, links, m, slots, seed=k)))
    from scipy.stats import spearmanr

    got = np.array(rows)
    error = np.abs(got[:, 0] / got[:, 1] - 1)
    print(f"1. model vs replay, 64 GPUs, 3 slow links: {len(got)} configurations/placements, "
          f"median error {np.median(error):.2%}, p90 {np.percentile(error, 90):.2%}, "
          f"max {error.max():.2%}, Spearman {spearmanr(got[:, 0], got[:, 1]).statistic:.4f}")


def margin() -> None:
    spec = cluster(8, SLOW_3)
    links = Links.of(spec)
    result = plan(MODEL_7B, spec, links, SearchSpec(top_k=1, micro_batch_sizes=(1, 2, 4)))
    best, uniform = result.ranked[0], result.uniform_choice
    assert uniform is not None and best.slots is not None

    def replay(c, slots) -> float:
        cfg = c.cfg
        return float(np.mean([
            simulate_step_s(cfg, stage_costs(MODEL_7B, spec, cfg), links,
                            cfg.microbatches(MODEL_7B), slots, seed=s) for s in range(3)]))

    sim_best = replay(best, best.slots)
    sim_uniform = replay(uniform, default_slots(uniform.cfg))
    print(f"2. recommendation {best.cfg.label()} (searched placement): model {best.step_s:.3f} s,"
          f" replay {sim_best:.3f} s")
    print(f"   uniform-link planner's choice {uniform.cfg.label()} (default placement): model "
          f"{uniform.default_step_s:.3f} s on the measured links ({uniform.uniform_step_s:.3f} s "
          f"as it assumes), replay {sim_uniform:.3f} s")
    print(f"   margin: predicted {uniform.default_step_s / best.step_s:.3f}×, simulated "
          f"{sim_uniform / sim_best:.3f}×")


class Counting:
    """Counts placements scored during a plan: latency-model evaluations (from scratch) and
    incremental proposals."""

    def __init__(self) -> None:
        self.placements = 0
        self._original = LatencyModel.step_s
        self._propose = IncrementalScore.propose

    def __enter__(self) -> Counting:
        counter = self

        def step_s(model: LatencyModel, slots: np.ndarray) -> np.ndarray:
            counter.placements += 1 if slots.ndim == 2 else len(slots)
            return counter._original(model, slots)

        def propose(score: IncrementalScore, a: int, b: int) -> float:
            counter.placements += 1
            return counter._propose(score, a, b)

        LatencyModel.step_s = step_s  # type: ignore[method-assign]
        IncrementalScore.propose = propose  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        LatencyModel.step_s = self._original  # type: ignore[method-assign]
        IncrementalScore.propose = self._propose  # type: ignore[method-assign]


def big_cluster(gpus: int) -> tuple[ClusterSpec, ModelSpec]:
    hosts = gpus // 8
    slow = SLOW_3 if hosts == 8 else random_slow(hosts, 3 * hosts // 8, seed=hosts)
    return cluster(hosts, slow), (MODEL_7B if gpus <= 64 else MODEL_70B)


def search_time(sizes: list[int]) -> None:
    print("3. search time (CPU s, one core); before = from-scratch scoring, after = incremental")
    print(f"{'GPUs':>6} {'model':>5} {'slow links':>10} {'configs':>7} {'baseline s':>10} "
          f"{'scoring':>11} {'plan s':>8} {'placements scored':>17} {'µs/placement':>12} "
          f"{'best':>18} {'step s':>8} {'vs default':>10}")
    for gpus in sizes:
        spec, model = big_cluster(gpus)
        links = Links.of(spec)
        search_spec = SearchSpec(top_k=1, micro_batch_sizes=(1, 2))
        t0 = time.process_time()
        configs, _ = configurations(model, spec, search_spec)
        scored = 0
        for cfg in configs:
            if memory_problem(model, spec, cfg)[1] is None:
                LatencyModel(cfg, stage_costs(model, spec, cfg), links,
                             cfg.microbatches(model)).step_s(default_slots(cfg))
                scored += 1
        baseline = time.process_time() - t0
        for scoring in ("full", "incremental"):
            with Counting() as counting:
                t0 = time.process_time()
                result = plan(model, spec, links, search_spec, scoring=scoring)
                took = time.process_time() - t0
            best = result.ranked[0]
            print(f"{gpus:>6} {'7B' if model is MODEL_7B else '70B':>5} {len(spec.links):>10} "
                  f"{scored:>7} {baseline:>10.3f} {scoring:>11} {took:>8.1f} "
                  f"{counting.placements:>17,} {1e6 * took / counting.placements:>12.0f} "
                  f"{best.cfg.label():>18} {best.step_s:>8.4f} "
                  f"{best.default_step_s / best.step_s - 1:>9.1%}", flush=True)


def lower_bound(model: LatencyModel, spec: ClusterSpec) -> float | None:
    """When a slot is a whole host (tp = GPUs per host), every link a placement uses is a
    host-to-host link, none faster than nominal here: the score with all links nominal (the
    same for every placement) bounds every placement's from below. None otherwise."""
    links = model.links
    nominal = spec.inter_host_gbit_per_s * GBIT
    off = ~np.eye(links.hosts, dtype=bool)
    if (model.cfg.tp != spec.gpus_per_host or links.host_bytes_per_s[off].max() > nominal
            or np.isfinite(links.gpu_cap_bytes_per_s).any()):
        return None
    uniform = LatencyModel(model.cfg, model.costs, Links.uniform(spec), model.m)
    return float(uniform.step_s(default_slots(model.cfg)))


def improving_swaps(model: LatencyModel, slots: np.ndarray) -> tuple[int, int]:
    """Every single swap of the placement, scored incrementally: (improving, tried)."""
    score = IncrementalScore(model, slots)
    groups, better = slots.size, 0
    for a in range(groups):
        for b in range(a + 1, groups):
            better += score.propose(a, b) < score.total * (1 - 1e-12)
            score.reject()
    return better, groups * (groups - 1) // 2


def convergence(gpus: int) -> None:
    """The evidence of convergence, per configuration the plan searched: the search before
    (from scratch) and after (incremental), when the best last improved, a 5× longer cooling
    from another seed, a lower bound where one is known, and for the recommendation every
    single swap of its placement tried (0 improving: a local optimum)."""
    spec, model_spec = big_cluster(gpus)
    links = Links.of(spec)
    result = plan(model_spec, spec, links, SearchSpec(top_k=8, micro_batch_sizes=(1, 2)))
    print(f"4. convergence at {gpus:,} GPUs: the 8 searched configurations, from the default "
          "placement (CPU s, one core)")
    print(f"{'configuration':>18} {'groups':>6} {'before s':>8} {'before':>8} {'after s':>7} "
          f"{'after':>8} {'last improved/proposals':>23} {'5x longer':>10} "
          f"{'lower bound':>11} {'improving swaps':>15}")
    for c in result.ranked:
        latency = LatencyModel(c.cfg, stage_costs(model_spec, spec, c.cfg), links,
                               c.cfg.microbatches(model_spec))
        groups = c.cfg.dp * c.cfg.pp
        t0 = time.process_time()
        before = anneal(latency, scoring="full")
        before_s = time.process_time() - t0
        t0 = time.process_time()
        after = anneal(latency)
        after_s = time.process_time() - t0
        longer = anneal(latency, iterations=5 * default_iterations(groups), seed=1)
        bound = lower_bound(latency, spec)
        # The 2-opt certificate costs groups²/2 proposals: for the recommendation only.
        swaps = improving_swaps(latency, after.slots) if c is result.ranked[0] else None
        print(f"{c.cfg.label():>18} {groups:>6} {before_s:>8.1f} {before.step_s:>8.4f} "
              f"{after_s:>7.1f} {after.step_s:>8.4f} "
              f"{f'{after.last_improved:,}/{after.proposals:,}':>23} {longer.step_s:>10.4f} "
              f"{'n/a' if bound is None else f'{bound:.4f}':>11} "
              f"{'n/a' if swaps is None else f'{swaps[0]} of {swaps[1]:,}':>15}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="search time for 64 and 512 GPUs")
    parser.add_argument("--only", choices=("accuracy", "margin", "time", "convergence"))
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if args.only in (None, "accuracy"):
        model_vs_replay()
    if args.only in (None, "margin"):
        margin()
    if args.only in (None, "time"):
        search_time([64, 512] if args.quick else [64, 512, 4096])
    if args.only in (None, "convergence"):
        convergence(512 if args.quick else 4096)


if __name__ == "__main__":
    main()
