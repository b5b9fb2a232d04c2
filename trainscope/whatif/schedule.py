"""Megatron pipeline schedules for the synthetic traces, and the graph the synthetic job runs.

A stage's schedule is the order its host issues ops in (1F1B, or interleaved when vpp_size > 1).
The job runs a stricter graph than the analysis assumes: each host issues one op (or one
batched call) after another, so the analysis model is a relaxation of it and replaying a
generated trace with its launch delays reproduces it exactly.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from trainscope.schemas import optypes as ot
from trainscope.whatif.graph import Graph, Template, build_graph, topological_order

if TYPE_CHECKING:
    from trainscope.whatif.generate import JobSpec


class Op(NamedTuple):
    code: int
    chunk: int
    mb: int
    batched: bool = False  # issued together with the previous op (one batched p2p call)


def stage_schedule(spec: JobSpec, stage: int) -> list[Op]:
    """One stage's ops in the order its host issues them (Megatron 1F1B, interleaved when
    vpp_size > 1). A send followed by a recv of the other direction is one batched call, as in
    Megatron's "send forward, receive backward" and "send backward, receive forward"."""
    p, v, m = spec.pp_size, spec.vpp_size, spec.microbatches
    if v > 1 and m % p:
        raise ValueError(f"interleaved schedules need microbatches ({m}) divisible by pp ({p})")
    total = m * v
    warmup = min(total, (p - stage - 1) * 2 + (v - 1) * p if v > 1 else p - stage - 1)
    issued = _StageOps(spec, stage)
    if spec.noop_p2p and stage == 0:
        # The profiler records p2p calls that never reach the network: a backward send on
        # the first stage before any compute, ...
        issued.add(ot.BACKWARD_SEND)
    for k in range(warmup):
        issued.forward(k)
    for i in range(total - warmup):
        issued.forward(warmup + i)
        issued.backward(i)
    for i in range(total - warmup, total):
        issued.backward(i)
    if spec.noop_p2p and stage == p - 1:
        # ... and a backward recv on the last stage after its last compute.
        issued.add(ot.BACKWARD_RECV)
    issued.step_end()
    return issued.ops


class _StageOps:
    """One stage's ops as :func:`stage_schedule` issues them: a forward or backward pass of a
    micro-batch with its p2p transfers, and the end of the step."""

    def __init__(self, spec: JobSpec, stage: int) -> None:
        self.spec, self.stage = spec, stage
        self.p, self.v = spec.pp_size, spec.vpp_size
        self.last_g = self.p * self.v - 1  # the last model chunk over all stages
        self.ops: list[Op] = []
        self.gathered: set[int] = set()  # chunks whose parameters were all-gathered
        self.backwards_left = {c: spec.microbatches for c in range(self.v)}
        self.overlap = spec.distributed_optimizer and spec.overlap_grad_reduce

    def chunk_mb(self, k: int, backward: bool) -> tuple[int, int]:
        """(model chunk, micro-batch) of the k-th forward or backward pass."""
        p, v = self.p, self.v
        c = (k // p) % v if v > 1 else 0
        mb = (k // (p * v)) * p + k % p if v > 1 else k
        return (v - 1 - c if backward else c), mb

    def add(self, code: int, c: int = -1, mb: int = -1) -> None:
        prev = self.ops[-1] if self.ops else None
        if prev is None or prev.code not in ot.P2P or code not in ot.P2P:
            batched = False
        elif self.v > 1:
            batched = False  # interleaved schedules are generated without batching
        else:
            # 1F1B: a send then a recv of the other direction ("send forward, recv backward").
            batched = (
                prev.code in ot.P2P_PEER
                and code in (ot.FORWARD_RECV, ot.BACKWARD_RECV)
                and ot.P2P_COMPUTE[code] != ot.P2P_COMPUTE[prev.code]
            )
        self.ops.append(Op(code, c, mb, batched))

    def forward(self, k: int) -> None:
        c, mb = self.chunk_mb(k, False)
        g = c * self.p + self.stage
        if self.spec.distributed_optimizer and c not in self.gathered:
            self.gathered.add(c)
            self.add(ot.PARAMS_ALL_GATHER, c)
        if g > 0:
            self.add(ot.FORWARD_RECV, c, mb)
        self.add(ot.FORWARD_COMPUTE, c, mb)
        if g < self.last_g:
            self.add(ot.FORWARD_SEND, c, mb)

    def backward(self, k: int) -> None:
        c, mb = self.chunk_mb(k, True)
        g = c * self.p + self.stage
        if g < self.last_g:
            self.add(ot.BACKWARD_RECV, c, mb)
        self.add(ot.BACKWARD_COMPUTE, c, mb)
        if g > 0:
            self.add(ot.BACKWARD_SEND, c, mb)
        self.backwards_left[c] -= 1
        if self.overlap and self.backwards_left[c] == 0:
            self.add(ot.GRADS_REDUCE_SCATTER, c)

    def step_end(self) -> None:
        """GC, the gradient and embedding reductions, clipping and the optimizer."""
        spec, p = self.spec, self.p
        if spec.gc:
            self.add(ot.GC)
        self.add(ot.LAYERNORM_ALL_REDUCE)
        if p > 1 and self.stage in (0, p - 1):
            self.add(ot.EMBEDDING_ALL_REDUCE)
        if not spec.distributed_optimizer or self.overlap:
            self.add(ot.SEPARATE_ALL_REDUCE)
        else:
            for c in range(self.v):
                self.add(ot.GRADS_REDUCE_SCATTER, c)
        self.add(ot.CLIP)
        self.add(ot.OPTIMIZER)


def host_graph(
    spec: JobSpec,
    schedules: list[list[Op]],
    node_stage: np.ndarray,
    node_op: np.ndarray,
    node_seq: np.ndarray,
    node_mc: np.ndarray,
) -> tuple[Graph, list[list[int]]]:
    """The graph the synthetic job runs: each host issues its ops one after another (a
    batched call is one unit), and the cross-rank groups are those of the analysis model
    plus, for a batched call, the groups of all its ops. The analysis model's dependencies are
    a relaxation of this one, so replaying a generated trace with its launch delays kept
    reproduces it."""
    units: list[list[int]] = []
    n = 0
    for sched in schedules:
        for op in sched:
            if op.batched:
                units[-1].append(n)
            else:
                units.append([n])
            n += 1
    position = np.empty(n)
    for i, unit in enumerate(units):
        position[unit] = i
    template = Template(
        stage=node_stage,
        op=node_op,
        seq=node_seq,
        mc=node_mc,
        start_s=position,
        end_s=position + 0.5,
        pp_size=spec.pp_size,
        vpp_size=spec.vpp_size,
        data_parallel=spec.dp_size * spec.dsp_size > 1,
    )
    model = build_graph(template)
    deps = [set(d) for d in model.deps]
    peers = [set(p) for p in model.peers]
    last_blocking: list[int] = []
    for i, unit in enumerate(units):
        if i and node_stage[units[i - 1][0]] != node_stage[unit[0]]:
            last_blocking = []
        for m in unit:
            deps[m].update(last_blocking)
            for other in unit:
                peers[m] |= {other, *model.peers[other]}
            peers[m].discard(m)
        last_blocking = unit
    if spec.vpp_size > 1:
        # Our interleaved order is not Megatron's, and with blocking sends it would deadlock:
        # there a send completes on its own (the data is buffered), as sends of small
        # activations do.
        for m in np.flatnonzero(np.isin(node_op, list(ot.P2P_PEER))):
            peers[m] = set()
    peer_t = tuple(tuple(sorted(p)) for p in peers)
    dep_t = tuple(tuple(sorted(d)) for d in deps)
    host = replace(
        model,
        deps=dep_t,
        peers=peer_t,
        order=topological_order(dep_t, peer_t, template),
    )
    return host, units
