"""Per-operation times of one configuration, before placement: compute per stage, and the bytes
each kind of communication moves (the link it crosses is the placement's business).

Compute runs at ``mfu`` of the GPU's peak; a backward costs ``backward_over_forward`` (2) times
its forward, one forward more with full recomputation. Every layer does two tensor-parallel
all-reduces of the hidden states in its forward and two in its backward (Megatron without
sequence parallelism). A pipeline send
moves one micro-batch's hidden states, split over the tensor-parallel ranks (each sends its
1/tp slice over its own link). The data-parallel gradient all-reduce moves each GPU's gradient
shard in a ring: 2·(dp − 1)/dp of it over the ring's slowest link.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainscope.plan.spec import ClusterSpec, ModelSpec
from trainscope.plan.transformer import (
    ELEMENT_BYTES,
    ParallelConfig,
    stage_forward_flops,
    stage_params,
)

GRAD_BYTES = {"fp32": 4, "bf16": 2, "mixed": 4}
# Optimizer step: bytes of HBM traffic per parameter (read and write weights, gradients and
# state); the step is memory-bound.
OPTIMIZER_TRAFFIC_BYTES = {"adam": 32, "sgd": 12}


@dataclass(frozen=True)
class StageCosts:
    """What one micro-batch costs on each stage (arrays of length pp, seconds or bytes)."""

    forward_s: np.ndarray  # compute only, one model chunk's worth summed over chunks
    backward_s: np.ndarray
    tp_bytes_per_layer: float  # one all-reduce's payload per GPU
    tp_allreduces: np.ndarray  # all-reduces per micro-batch (forward + backward) per stage
    p2p_bytes: float  # per tensor-parallel rank, one direction, one micro-batch
    grad_bytes: np.ndarray  # gradient shard per GPU of each stage
    optimizer_s: np.ndarray


def stage_costs(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig) -> StageCosts:
    p, t, b = cfg.pp, cfg.tp, cfg.micro_batch
    flops_per_s = cluster.peak_tflops * 1e12 * cluster.mfu
    forward_s = np.asarray(stage_forward_flops(model, cfg)) / t / flops_per_s
    backward_s = forward_s * (cluster.backward_over_forward + (1.0 if model.recompute else 0.0))
    e = ELEMENT_BYTES[model.precision]
    hidden_bytes = b * model.seq_len * model.hidden * e
    params = np.array([stage_params(model, cfg, s) for s in range(p)], dtype=np.float64)
    traffic = OPTIMIZER_TRAFFIC_BYTES[model.optimizer]
    return StageCosts(
        forward_s=forward_s,
        backward_s=backward_s,
        tp_bytes_per_layer=hidden_bytes,
        tp_allreduces=np.full(p, 4.0 * (model.layers // p) if t > 1 else 0.0),
        p2p_bytes=hidden_bytes / t,
        grad_bytes=params * GRAD_BYTES[model.precision],
        optimizer_s=params * traffic / (cluster.hbm_gbyte_per_s * 1e9),
    )


def ring_allreduce_s(payload_bytes: float | np.ndarray, members: int,
                     slowest_bytes_per_s: np.ndarray | float) -> np.ndarray | float:
    """A ring all-reduce: each member sends 2·(n − 1)/n of the payload over its ring link."""
    if members <= 1:
        return np.zeros_like(np.asarray(slowest_bytes_per_s, dtype=np.float64))
    return 2 * (members - 1) / members * payload_bytes / slowest_bytes_per_s
