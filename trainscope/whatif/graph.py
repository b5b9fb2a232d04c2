"""The dependency model of one training step, over the template ops of all pipeline stages.

A node is one template op (see :mod:`layout`); the same graph holds for every step and every DP
rank. Two events belong to each node: its start and its end.

- start(n) waits for end(pred(n)): the worker's previous op in recorded order.
- end(n) waits for start(n) and for start(p) of every peer p; for a data-parallel collective
  also for start(n) on every DP rank. A receive's peer is the matching send; a send waits for
  nobody (the receiver does the waiting).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from trainscope.whatif import optypes as ot
from trainscope.whatif.trace import TraceError


@dataclass(frozen=True)
class Graph:
    pred: np.ndarray  # (nodes,) previous op of the same worker, -1 for the first
    peers: tuple[tuple[int, ...], ...]  # nodes whose start gates this node's end
    dp_wide: np.ndarray  # (nodes,) bool: the end also waits for all DP ranks of the node
    order: tuple[int, ...]  # events in topological order: n = start(n), nodes + n = end(n)
    final_nodes: np.ndarray  # optimizer nodes: the step ends at the last of their ends

    @property
    def nodes(self) -> int:
        return len(self.pred)


def build_graph(
    node_stage: np.ndarray,
    node_op: np.ndarray,
    node_seq: np.ndarray,
    node_mc: np.ndarray,
    node_gmc: np.ndarray,
    node_mb: np.ndarray,
    stage_offsets: np.ndarray,
) -> Graph:
    n_nodes = len(node_op)
    pp_size = len(stage_offsets) - 1
    pred = np.arange(n_nodes) - 1
    pred[stage_offsets[:-1][np.diff(stage_offsets) > 0]] = -1
    chunk = np.where(
        node_gmc >= 0, node_gmc, np.where(node_mc >= 0, node_mc * pp_size + node_stage, node_stage)
    )
    p2p_key = _p2p_keys(node_op, chunk, node_mb, stage_offsets)

    sends: dict[tuple[int, int, int], int] = {}
    for n in range(n_nodes):
        if node_op[n] in (ot.FORWARD_SEND, ot.BACKWARD_SEND):
            sends[(int(node_op[n]), *p2p_key[n])] = n
    same_op: dict[tuple[int, int], list[int]] = {}
    for n in range(n_nodes):
        same_op.setdefault((int(node_op[n]), int(node_seq[n])), []).append(n)

    peers: list[tuple[int, ...]] = []
    for n in range(n_nodes):
        code = int(node_op[n])
        if code in (ot.FORWARD_RECV, ot.BACKWARD_RECV):
            send_op, step = (
                (ot.FORWARD_SEND, -1) if code == ot.FORWARD_RECV else (ot.BACKWARD_SEND, 1)
            )
            g, mb = p2p_key[n]
            match = sends.get((send_op, g + step, mb))
            if match is None:
                raise TraceError(
                    f"{ot.OPTYPES[code]} #{node_seq[n]} on stage {node_stage[n]} (model chunk "
                    f"{g}, micro-batch {mb}) has no matching {ot.OPTYPES[send_op]}"
                )
            peers.append((match,))
        elif code in ot.STAGE_COLLECTIVES:
            ends = {0, pp_size - 1}
            group = same_op[(code, int(node_seq[n]))]
            peers.append(tuple(p for p in group if p != n and int(node_stage[p]) in ends))
        elif code in ot.GLOBAL_COLLECTIVES:
            peers.append(tuple(p for p in same_op[(code, int(node_seq[n]))] if p != n))
        else:
            peers.append(())
    dp_wide = np.isin(node_op, list(ot.DP_COLLECTIVES | ot.GLOBAL_COLLECTIVES))
    order = _topological_order(pred, peers, node_stage, node_op, node_seq)
    final_nodes = np.flatnonzero(node_op == ot.OPTIMIZER)
    if len(final_nodes) == 0:
        raise TraceError("the trace has no optimizer op, so no step ever ends")
    return Graph(pred, tuple(peers), dp_wide, order, final_nodes)


def _p2p_keys(node_op, chunk, node_mb, stage_offsets) -> list[tuple[int, int]]:
    """(model chunk, micro-batch) of every node; for sends and receives without a micro-batch
    id, those of the compute op they feed (receive) or drain (send)."""
    keys = [(int(chunk[n]), int(node_mb[n])) for n in range(len(node_op))]
    follows = {
        ot.FORWARD_RECV: (ot.FORWARD_COMPUTE, 1),
        ot.BACKWARD_RECV: (ot.BACKWARD_COMPUTE, 1),
        ot.FORWARD_SEND: (ot.FORWARD_COMPUTE, -1),
        ot.BACKWARD_SEND: (ot.BACKWARD_COMPUTE, -1),
    }
    for s in range(len(stage_offsets) - 1):
        lo, hi = int(stage_offsets[s]), int(stage_offsets[s + 1])
        for n in range(lo, hi):
            code = int(node_op[n])
            if code not in follows or node_mb[n] >= 0:
                continue
            compute, direction = follows[code]
            m = n + direction
            while lo <= m < hi and node_op[m] != compute:
                m += direction
            if lo <= m < hi:
                keys[n] = (int(chunk[m]), int(node_mb[m]))
    return keys


def _topological_order(pred, peers, node_stage, node_op, node_seq) -> tuple[int, ...]:
    n_nodes = len(pred)
    successors: list[list[int]] = [[] for _ in range(2 * n_nodes)]
    indegree = [0] * (2 * n_nodes)
    for n in range(n_nodes):
        edges = [(n, n_nodes + n)]
        if pred[n] >= 0:
            edges.append((n_nodes + int(pred[n]), n))
        edges.extend((p, n_nodes + n) for p in peers[n])
        for src, dst in edges:
            successors[src].append(dst)
            indegree[dst] += 1
    ready = deque(e for e, d in enumerate(indegree) if d == 0)
    order: list[int] = []
    while ready:
        event = ready.popleft()
        order.append(event)
        for nxt in successors[event]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                ready.append(nxt)
    if len(order) < 2 * n_nodes:
        stuck = sorted({e % n_nodes for e, d in enumerate(indegree) if d > 0})[:3]
        names = "; ".join(
            f"{ot.OPTYPES[node_op[n]]} #{node_seq[n]} on stage {node_stage[n]}" for n in stuck
        )
        raise TraceError(f"the dependency graph has a cycle through: {names}")
    return tuple(order)
