"""Step time of a configuration and a placement: the critical path of the 1F1B schedule.

A placement gives every tensor-parallel group — the tp ranks of one (data-parallel replica d,
pipeline stage s) — a *slot*: tp consecutive GPUs of one host (slot k holds GPUs k·tp …
k·tp + tp − 1). Ranks are Megatron's (tp fastest, then dp, then pp); the default placement puts
group (d, s) in slot s·dp + d.

Per replica d, with W_s = F_s + B_s (compute plus the tensor-parallel all-reduces of one
micro-batch on stage s) and c_s the pipeline transfer between stages s and s + 1 on that
replica's links:

    T_pipe(d) = Σ_s W_s + 2 Σ_s c_s + (m − 1) · max_s (W_s + c_(s−1) + c_s)

— the first micro-batch's way down and back, then m − 1 steady-state cycles of the slowest
stage, whose cycle also waits for its two batched exchanges. Stage s finishes its last
backward Σ_(j<s) (B_j + c_j) before stage 0 does; its data-parallel ring all-reduce (over the
placed ranks, at the ring's slowest link) starts when every replica got there, and the step ends
after the slowest stage's all-reduce and the optimizer.

Everything is vectorised over a leading batch of placements so the search can score thousands
at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainscope.plan.costs import StageCosts, ring_allreduce_s
from trainscope.plan.spec import Links
from trainscope.plan.transformer import ParallelConfig


@dataclass(frozen=True)
class Breakdown:
    """Model figures of one placement (seconds)."""

    step_s: float
    pipeline_s: float  # slowest replica's forward/backward span
    dp_allreduce_s: np.ndarray  # (pp,)
    p2p_s: np.ndarray  # (dp, pp − 1)
    tp_s: np.ndarray  # (dp, pp) per micro-batch
    bottleneck_stage: int


def default_slots(cfg: ParallelConfig) -> np.ndarray:
    """Megatron's order: group (d, s) in slot s·dp + d, as a (dp, pp) array."""
    return np.arange(cfg.dp * cfg.pp).reshape(cfg.pp, cfg.dp).T.copy()


def group_gpus(slots: np.ndarray, tp: int) -> np.ndarray:
    """(…, dp, pp) slots → (…, dp, pp, tp) GPU indices."""
    return slots[..., None] * tp + np.arange(tp)


class LatencyModel:
    """Scores placements of one configuration on one cluster's links."""

    def __init__(self, cfg: ParallelConfig, costs: StageCosts, links: Links,
                 microbatches: int) -> None:
        if cfg.virtual_stages != 1:
            raise ValueError("interleaved schedules (virtual_stages > 1) are not modelled yet")
        self.cfg, self.costs, self.links, self.m = cfg, costs, links, microbatches

    def parts(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        cfg, c, links = self.cfg, self.costs, self.links
        dp, pp, tp = cfg.dp, cfg.pp, cfg.tp
        gpus = group_gpus(slots, tp)  # (K, dp, pp, tp)
        if tp > 1:
            ring = links.between(gpus, np.roll(gpus, -1, axis=-1)).min(axis=-1)
            tp_s = c.tp_allreduces * ring_allreduce_s(c.tp_bytes_per_layer, tp, ring)
        else:
            tp_s = np.zeros(gpus.shape[:-1])
        fwd = c.forward_s + tp_s / 2
        bwd = c.backward_s + tp_s / 2
        if pp > 1:
            bw = links.between(gpus[..., :-1, :], gpus[..., 1:, :]).min(axis=-1)
            p2p = c.p2p_bytes / bw  # (K, dp, pp − 1)
        else:
            p2p = np.zeros((*gpus.shape[:-2], 0))
        if dp > 1:
            ring = links.between(gpus, np.roll(gpus, -1, axis=-3)).min(axis=-3)  # (K, pp, tp)
            allreduce = ring_allreduce_s(c.grad_bytes[:, None], dp, ring).max(axis=-1)
        else:
            allreduce = np.zeros((*gpus.shape[:-3], pp))
        return {"fwd": fwd, "bwd": bwd, "p2p": p2p, "allreduce": allreduce, "tp": tp_s}

    def step_s(self, slots: np.ndarray) -> np.ndarray:
        """Step time of each placement in a (K, dp, pp) batch (or one (dp, pp) placement)."""
        return self._step(self.parts(slots))[0]

    def _step(self, p: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        work = p["fwd"] + p["bwd"]  # (K, dp, pp)
        comm = p["p2p"]
        pad = np.zeros((*comm.shape[:-1], 1))
        around = np.concatenate([pad, comm], -1) + np.concatenate([comm, pad], -1)
        cycle = work + around
        pipe = work.sum(-1) + 2 * comm.sum(-1) + (self.m - 1) * cycle.max(-1)  # (K, dp)
        drain = np.cumsum(np.concatenate([pad, (p["bwd"][..., :-1] + comm)], -1), -1)
        backward_done = (pipe[..., None] - drain).max(-2)  # (K, pp)
        step = (backward_done + p["allreduce"]).max(-1) + self.costs.optimizer_s.max()
        return step, pipe, cycle

    def breakdown(self, slots: np.ndarray) -> Breakdown:
        p = self.parts(slots)
        step, pipe, cycle = self._step(p)
        return Breakdown(
            step_s=float(step),
            pipeline_s=float(pipe.max()),
            dp_allreduce_s=p["allreduce"],
            p2p_s=p["p2p"],
            tp_s=p["tp"],
            bottleneck_stage=int(np.unravel_index(np.argmax(cycle), cycle.shape)[-1]),
        )
