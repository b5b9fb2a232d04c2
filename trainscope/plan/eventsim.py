"""The reference the latency model is checked against: the placed job replayed op by op.

The job's dependency graph is the one the what-if engine's synthetic jobs run
(:func:`trainscope.whatif.schedule.host_graph`: Megatron 1F1B issue order per stage, batched
send/recv pairs that end only when both peers have started, a data-parallel all-reduce that
waits for every replica, a clip that waits for every stage), and the discrete-event replay is
the what-if engine's (:func:`trainscope.whatif.simulate.simulate`). Only the durations come from
here: every op's own time on its own ranks and links, with compute drawn with a little noise
around its nominal value. Nothing in this module shares code with :mod:`.latency`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from trainscope.plan.costs import StageCosts
from trainscope.plan.spec import Links
from trainscope.plan.transformer import ParallelConfig
from trainscope.schemas import optypes as ot
from trainscope.whatif.generate import JobSpec
from trainscope.whatif.schedule import host_graph, stage_schedule
from trainscope.whatif.simulate import simulate


def _gpu(slots: np.ndarray, tp: int, d: int, s: int, i: int) -> int:
    return int(slots[d, s]) * tp + i


def _bandwidth(links: Links, a: int, b: int) -> float:
    return float(links.between(np.array(a), np.array(b)))


def simulate_step_s(
    cfg: ParallelConfig,
    costs: StageCosts,
    links: Links,
    microbatches: int,
    slots: np.ndarray,
    *,
    noise: float = 0.02,
    seed: int = 0,
) -> float:
    dp, pp, tp = cfg.dp, cfg.pp, cfg.tp
    spec = JobSpec(dp_size=dp, pp_size=pp, tp_size=tp, microbatches=microbatches, steps=1,
                   distributed_optimizer=False, overlap_grad_reduce=False, noop_p2p=False,
                   gc=False)
    schedules = [stage_schedule(spec, s) for s in range(pp)]
    flat = [(s, op) for s, sched in enumerate(schedules) for op in sched]
    stage = np.array([s for s, _ in flat])
    code = np.array([op.code for _, op in flat])
    chunk = np.array([op.chunk for _, op in flat])
    seq = np.zeros(len(flat), dtype=np.int64)
    seen: dict[tuple[int, int], int] = {}
    for n, (s, op) in enumerate(flat):
        seq[n] = seen.get((s, op.code), 0)
        seen[(s, op.code)] = seq[n] + 1
    graph, _ = host_graph(spec, schedules, stage, code, seq, chunk)
    # The planner's models have untied input and output embeddings: the first and last stages
    # do not all-reduce embedding gradients with each other. Dropping the group's peers keeps
    # the event order valid (it only removes edges).
    untied = tuple(() if c == ot.EMBEDDING_ALL_REDUCE else p
                   for c, p in zip(code, graph.peers, strict=True))
    graph = replace(graph, peers=untied)

    # Link-level times, rank by rank.
    tp_s = np.zeros((dp, pp))
    if tp > 1:
        for d in range(dp):
            for s in range(pp):
                hops = [_bandwidth(links, _gpu(slots, tp, d, s, i),
                                   _gpu(slots, tp, d, s, (i + 1) % tp)) for i in range(tp)]
                # Each of the 2(tp − 1) ring steps moves 1/tp of the payload over every hop.
                per_step = max(costs.tp_bytes_per_layer / tp / bw for bw in hops)
                tp_s[d, s] = costs.tp_allreduces[s] * 2 * (tp - 1) * per_step
    p2p = np.zeros((dp, max(pp - 1, 0)))
    for d in range(dp):
        for s in range(pp - 1):
            p2p[d, s] = max(
                costs.p2p_bytes / _bandwidth(links, _gpu(slots, tp, d, s, i),
                                             _gpu(slots, tp, d, s + 1, i))
                for i in range(tp)
            )
    allreduce = np.zeros(pp)
    if dp > 1:
        for s in range(pp):
            for i in range(tp):
                ring = [_gpu(slots, tp, d, s, i) for d in range(dp)]
                chunk_bytes = costs.grad_bytes[s] / dp
                step_s = max(chunk_bytes / _bandwidth(links, a, b)
                             for a, b in zip(ring, ring[1:] + ring[:1], strict=True))
                allreduce[s] = max(allreduce[s], 2 * (dp - 1) * step_s)

    rng = np.random.default_rng(seed)
    duration = np.zeros((graph.nodes, dp))
    for n in range(graph.nodes):
        s, c = int(stage[n]), int(code[n])
        jitter = rng.lognormal(0.0, noise, dp) if noise else np.ones(dp)
        if c == ot.FORWARD_COMPUTE:
            duration[n] = (costs.forward_s[s] + tp_s[:, s] / 2) * jitter
        elif c == ot.BACKWARD_COMPUTE:
            duration[n] = (costs.backward_s[s] + tp_s[:, s] / 2) * jitter
        elif c in (ot.FORWARD_SEND, ot.BACKWARD_RECV):  # the link to stage s + 1
            duration[n] = p2p[:, s]
        elif c in (ot.FORWARD_RECV, ot.BACKWARD_SEND):  # the link to stage s − 1
            duration[n] = p2p[:, s - 1]
        elif c == ot.SEPARATE_ALL_REDUCE:
            duration[n] = allreduce[s]
        elif c == ot.OPTIMIZER:
            duration[n] = costs.optimizer_s[s] * jitter
    replay = simulate(graph, duration, (dp,))
    return float(replay.step_time_s)
