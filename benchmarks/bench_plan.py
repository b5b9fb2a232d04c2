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
from trainscope.plan.latency import LatencyModel, default_slots  # noqa: E402
from trainscope.plan.recommend import configurations, memory_problem, plan  # noqa: E402
from trainscope.plan.search import search  # noqa: E402
from trainscope.plan.spec import ClusterSpec, HostLink, Links, ModelSpec, SearchSpec  # noqa: E402
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
    """Counts latency-model evaluations (placements scored) during a plan."""

    def __init__(self) -> None:
        self.placements = 0
        self._original = LatencyModel.step_s

    def __enter__(self) -> Counting:
        counter = self

        def step_s(model: LatencyModel, slots: np.ndarray) -> np.ndarray:
            counter.placements += 1 if slots.ndim == 2 else len(slots)
            return counter._original(model, slots)

        LatencyModel.step_s = step_s  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        LatencyModel.step_s = self._original  # type: ignore[method-assign]


def search_time(sizes: list[int]) -> None:
    print("3. search time (CPU s, one core)")
    print(f"{'GPUs':>6} {'model':>5} {'slow links':>10} {'configs':>7} {'baseline s':>10} "
          f"{'plan s':>8} {'plan ÷ baseline':>15} {'placements scored':>17} {'µs/placement':>12} "
          f"{'best':>18} {'vs default':>10}")
    for gpus in sizes:
        hosts = gpus // 8
        slow = SLOW_3 if hosts == 8 else random_slow(hosts, 3 * hosts // 8, seed=hosts)
        spec = cluster(hosts, slow)
        model = MODEL_7B if gpus <= 64 else MODEL_70B
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
        with Counting() as counting:
            t0 = time.process_time()
            result = plan(model, spec, links, search_spec)
            took = time.process_time() - t0
        best = result.ranked[0]
        print(f"{gpus:>6} {'7B' if model is MODEL_7B else '70B':>5} {len(slow):>10} "
              f"{scored:>7} {baseline:>10.3f} {took:>8.1f} {took / baseline:>15.0f} "
              f"{counting.placements:>17,} {1e6 * took / counting.placements:>12.0f} "
              f"{best.cfg.label():>18} {best.default_step_s / best.step_s - 1:>9.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="search time for 64 and 512 GPUs")
    parser.add_argument("--only", choices=("accuracy", "margin", "time"))
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if args.only in (None, "accuracy"):
        model_vs_replay()
    if args.only in (None, "margin"):
        margin()
    if args.only in (None, "time"):
        search_time([64, 512] if args.quick else [64, 512, 4096])


if __name__ == "__main__":
    main()
