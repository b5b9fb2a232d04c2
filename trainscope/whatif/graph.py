"""The dependency model of one training step, over the template ops of all pipeline stages.

A node is one template op (see :mod:`layout`); the graph is built once from the start and end
times of one model-parallel group (DP rank 0) in one step, and the same graph holds for every
step and every DP rank. Two events belong to each node, its start and its end:

- start(n) waits for end(d) of every dependency d (same worker);
- end(n) waits for start(n) and start(p) of every other member p of its group, on every DP rank
  for a data-parallel collective.

Inside a stage, compute ops form one chain and each point-to-point type is its own stream
(a chain), so a batched "send forward, receive backward" — a send and a recv with the same
start — is two ops on two streams, not an order between them. Sends and recvs are attached to
compute ops by time; ops the profiler recorded but that were never launched are detached.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas import optypes as ot
from trainscope.schemas.optrace import TraceError


@dataclass(frozen=True)
class Graph:
    deps: tuple[tuple[int, ...], ...]  # ends that gate each node's start (same worker)
    peers: tuple[tuple[int, ...], ...]  # other group members whose starts gate the end
    dp_wide: np.ndarray  # (nodes,) bool: the end also waits for all DP ranks of the node
    order: tuple[int, ...]  # events in topological order: n = start(n), nodes + n = end(n)
    final_nodes: np.ndarray  # optimizer nodes: the step ends at the last of their ends
    noop: np.ndarray  # (nodes,) bool: recorded but never launched (a lone p2p op)
    notes: tuple[str, ...] = field(default=())  # model-fit remarks worth a warning

    @property
    def nodes(self) -> int:
        return len(self.deps)


@dataclass(frozen=True)
class Template:
    """What the graph is built from: one entry per template op, times from one step of DP
    rank 0 (seconds, any origin)."""

    stage: np.ndarray
    op: np.ndarray
    seq: np.ndarray
    mc: np.ndarray  # model chunk, -1 where unknown
    start_s: np.ndarray
    end_s: np.ndarray
    pp_size: int
    vpp_size: int = 1
    data_parallel: bool = True  # dp_size × dsp_size > 1


class _Builder:
    def __init__(self, t: Template) -> None:
        self.t = t
        n = len(t.op)
        self.deps: list[set[int]] = [set() for _ in range(n)]
        self.groups: list[list[int]] = []
        self.noop = np.zeros(n, dtype=bool)
        self.notes: list[str] = []
        # p2p ops of each (stage, type) that were launched, in time order.
        self.valid: dict[tuple[int, int], list[int]] = {}

    def in_order(self, nodes: np.ndarray) -> list[int]:
        """Nodes by start time; ties broken by op identity so row order never matters."""
        t = self.t
        keys = np.lexsort((t.seq[nodes], t.op[nodes], t.start_s[nodes]))
        return [int(x) for x in nodes[keys]]

    def chain(self, nodes: list[int]) -> None:
        for prev, nxt in itertools.pairwise(nodes):
            self.deps[nxt].add(prev)

    def stage(self, s: int) -> None:
        t = self.t
        mine = np.flatnonzero(t.stage == s)
        of = {code: self.in_order(mine[t.op[mine] == code]) for code in ot.CODE.values()}
        computes = self.in_order(
            mine[np.isin(t.op[mine], (ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE))]
        )
        self.chain(computes)
        position = {n: i for i, n in enumerate(computes)}
        first_bwd_dep = self._first_backward_dependency(computes)
        for code in ot.P2P:
            stream = of[code]
            self.chain(stream)
            direction = of[ot.P2P_COMPUTE[code]]
            valid = self._launched(code, stream, direction)
            self.valid[(s, code)] = valid
            starts = t.start_s[direction]
            for k, n in enumerate(valid):
                if code in (ot.FORWARD_RECV, ot.BACKWARD_RECV):
                    i = int(np.searchsorted(starts, t.start_s[n], side="left"))
                    fed = direction[min(i, len(direction) - 1)]
                    self.deps[fed].add(n)
                    before = position[fed] - 1
                    dep = computes[before] if before >= 0 else None
                else:
                    # Strictly before: a compute starting with the send is the next one.
                    i = int(np.searchsorted(starts, t.start_s[n], side="left")) - 1
                    dep = direction[i] if i >= 0 else None
                if k == 0 and code in (ot.BACKWARD_SEND, ot.BACKWARD_RECV) and first_bwd_dep:
                    dep = first_bwd_dep
                if dep is not None:
                    self.deps[n].add(dep)
        self._data_parallel(of)
        self._after_backward(of, computes)

    def _first_backward_dependency(self, computes: list[int]) -> int | None:
        """The published model's rule for the first backward send/recv of a stage: it depends
        on the second-to-last forward compute before the first backward compute, because
        Megatron issues it inside a batched "send forward, receive backward" call rather than
        after the compute it belongs to. (Where a recv waits for its peer, as in every step of
        the ST trace, this does not change the replay.)"""
        forwards: list[int] = []
        for n in computes:
            if self.t.op[n] == ot.BACKWARD_COMPUTE:
                break
            forwards.append(n)
        return forwards[-2] if len(forwards) >= 2 else None

    def _launched(self, code: int, stream: list[int], direction: list[int]) -> list[int]:
        """The ops of a p2p stream that were launched. The profiler also records never-launched
        ones: recvs that start after the last compute of their direction, sends that end
        before its first compute. Those become lone ops that gate nothing."""
        t = self.t
        if not direction:
            keep = np.zeros(len(stream), dtype=bool)
        elif code in (ot.FORWARD_RECV, ot.BACKWARD_RECV):
            keep = t.start_s[stream] <= t.start_s[direction[-1]]
        else:
            keep = t.end_s[stream] >= t.start_s[direction[0]]
        self.noop[np.asarray(stream, dtype=np.int64)[~keep]] = True
        return [n for n, k in zip(stream, keep, strict=True) if k]

    def _data_parallel(self, of: dict[int, list[int]]) -> None:
        t = self.t
        dp_ops = self.in_order(
            np.asarray(of[ot.PARAMS_ALL_GATHER] + of[ot.GRADS_REDUCE_SCATTER], dtype=np.int64)
        )
        self.chain(dp_ops)
        if not self.t.data_parallel:
            return
        forwards = of[ot.FORWARD_COMPUTE]
        backwards = of[ot.BACKWARD_COMPUTE]
        for k, gather in enumerate(of[ot.PARAMS_ALL_GATHER]):
            chunk = int(t.mc[gather]) if t.mc[gather] >= 0 else k
            first = next((f for f in forwards if _chunk(t, f) == chunk), None)
            if first is not None:
                self.deps[first].add(gather)
        if of[ot.SEPARATE_ALL_REDUCE]:
            for k, scatter in enumerate(of[ot.GRADS_REDUCE_SCATTER]):
                chunk = int(t.mc[scatter]) if t.mc[scatter] >= 0 else k
                last = [b for b in backwards if _chunk(t, b) == chunk]
                if last:
                    self.deps[scatter].add(last[-1])

    def _after_backward(self, of: dict[int, list[int]], computes: list[int]) -> None:
        """last compute → gc → layernorm → embedding → grad sync → clip → optimizer."""
        sync: list[int] = []
        if self.t.data_parallel:
            sync = of[ot.SEPARATE_ALL_REDUCE] or of[ot.GRADS_REDUCE_SCATTER]
        tail = computes[-1:] + [
            n
            for code in (ot.GC, ot.LAYERNORM_ALL_REDUCE, ot.EMBEDDING_ALL_REDUCE)
            for n in of[code]
        ]
        tail += sync + of[ot.CLIP] + of[ot.OPTIMIZER]
        self.chain(tail)
        if self.t.data_parallel and of[ot.SEPARATE_ALL_REDUCE] and of[ot.GRADS_REDUCE_SCATTER]:
            self.deps[of[ot.SEPARATE_ALL_REDUCE][0]].add(of[ot.GRADS_REDUCE_SCATTER][-1])

    def cross_rank(self) -> None:
        t = self.t
        p, v = t.pp_size, t.vpp_size
        for send, (recv, direction) in ot.P2P_PEER.items():
            for s in range(p):
                peer = s + direction
                if v > 1:
                    peer %= p  # interleaved: the last stage feeds the first stage's next chunk
                sends = self.valid.get((s, send), [])
                recvs = self.valid.get((peer, recv), []) if 0 <= peer < p else []
                if len(sends) != len(recvs):
                    self.notes.append(
                        f"stage {s} has {len(sends)} launched {ot.OPTYPES[send]} op(s) but stage "
                        f"{peer} has {len(recvs)} {ot.OPTYPES[recv]}; the extra ones wait for "
                        "no peer"
                    )
                self.groups.extend([a, b] for a, b in zip(sends, recvs, strict=False))
        ends = sorted({0, p - 1})
        for code, stages in ((ot.EMBEDDING_ALL_REDUCE, ends), (ot.CLIP, list(range(p)))):
            per_stage = [
                self.in_order(np.flatnonzero((t.stage == s) & (t.op == code))) for s in stages
            ]
            for k in range(max((len(x) for x in per_stage), default=0)):
                self.groups.append([x[k] for x in per_stage if k < len(x)])


def _chunk(t: Template, node: int) -> int:
    return max(int(t.mc[node]), 0)


def build_graph(t: Template) -> Graph:
    b = _Builder(t)
    for s in range(t.pp_size):
        b.stage(s)
    b.cross_rank()
    n_nodes = len(t.op)
    peers: list[set[int]] = [set() for _ in range(n_nodes)]
    for group in b.groups:
        for n in group:
            peers[n].update(m for m in group if m != n)
    deps = tuple(tuple(sorted(d)) for d in b.deps)
    peer_t = tuple(tuple(sorted(p)) for p in peers)
    dp_wide = np.isin(t.op, [*ot.DP_COLLECTIVES, ot.CLIP])
    order = topological_order(deps, peer_t, t)
    final_nodes = np.flatnonzero(t.op == ot.OPTIMIZER)
    if len(final_nodes) == 0:
        raise TraceError("the trace has no optimizer op, so no step ever ends")
    return Graph(deps, peer_t, dp_wide, order, final_nodes, b.noop, tuple(b.notes))


def topological_order(
    deps: tuple[tuple[int, ...], ...], peers: tuple[tuple[int, ...], ...], t: Template
) -> tuple[int, ...]:
    n_nodes = len(deps)
    successors: list[list[int]] = [[] for _ in range(2 * n_nodes)]
    indegree = [0] * (2 * n_nodes)
    for n in range(n_nodes):
        edges = [(n, n_nodes + n)]
        edges.extend((n_nodes + d, n) for d in deps[n])
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
        names = "; ".join(f"{ot.OPTYPES[t.op[n]]} #{t.seq[n]} on stage {t.stage[n]}" for n in stuck)
        raise TraceError(f"the dependency graph has a cycle through: {names}")
    return tuple(order)
