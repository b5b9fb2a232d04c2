"""Topological replay of the dependency graph, vectorised over steps, DP ranks and scenarios.

Times are arrays of shape ``(nodes, *batch)`` where the last batch axis is the DP rank; the
leading batch axes are free (steps, scenarios). The Python loop runs over the graph's events
(two per template op), never over ranks or steps. Time 0 is the step's earliest real start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from trainscope.whatif.graph import Graph


class PerNode(Protocol):
    def __getitem__(self, node: int) -> np.ndarray | float: ...


class Mixed:
    """Per-node values taken from ``real`` where ``mask`` is true and from ``ideal`` elsewhere.

    Selecting per node inside the replay avoids materialising one full duration array per
    scenario.
    """

    def __init__(self, real: np.ndarray, ideal: np.ndarray, mask: np.ndarray) -> None:
        self.real, self.ideal, self.mask = real, ideal, mask

    def __getitem__(self, node: int) -> np.ndarray:
        return np.where(self.mask[node], self.real[node], self.ideal[node])


@dataclass
class Replay:
    step_time_s: np.ndarray  # batch shape without the DP axis
    start_s: np.ndarray | None = None  # (nodes, *batch) when kept
    end_s: np.ndarray | None = None


def simulate(
    graph: Graph,
    effective_s: PerNode,
    batch_shape: tuple[int, ...],
    delay_s: PerNode | None = None,
    keep_times: bool = False,
) -> Replay:
    """Replay one schedule.

    ``effective_s[n]``: compute duration, or transfer duration for communication (the time
    from the last group member's start to the end). ``delay_s[n]``: launch delay, the gap from
    the moment the op could start (its dependencies' last end, or the step start) to its start.
    """
    n_nodes = graph.nodes
    start = np.empty((n_nodes, *batch_shape), dtype=np.float64)
    end = np.empty_like(start)
    deps, peers, dp_wide = graph.deps, graph.peers, graph.dp_wide
    for event in graph.order:
        if event < n_nodes:
            ready = _latest(end, deps[event])
            if delay_s is None:
                start[event] = ready
            else:
                np.add(ready, delay_s[event], out=start[event])
        else:
            n = event - n_nodes
            gate = start[n]
            for q in peers[n]:
                gate = np.maximum(gate, start[q])
            if dp_wide[n]:
                gate = gate.max(axis=-1, keepdims=True)
            np.add(gate, effective_s[n], out=end[n])
    step_time = end[graph.final_nodes].max(axis=0).max(axis=-1)
    if keep_times:
        return Replay(step_time, start, end)
    return Replay(step_time)


def _latest(times: np.ndarray, nodes: tuple[int, ...]) -> np.ndarray | float:
    if not nodes:
        return 0.0
    ready = times[nodes[0]]
    for d in nodes[1:]:
        ready = np.maximum(ready, times[d])
    return ready


def gate_times(graph: Graph, start_s: np.ndarray) -> np.ndarray:
    """For observed starts ``(nodes, steps, dp)``: when each op's last group member started."""
    gate = start_s.copy()
    for n in range(graph.nodes):
        for q in graph.peers[n]:
            np.maximum(gate[n], start_s[q], out=gate[n])
        if graph.dp_wide[n]:
            gate[n] = gate[n].max(axis=-1, keepdims=True)
    return gate


def ready_times(graph: Graph, end_s: np.ndarray) -> np.ndarray:
    """For observed ends: when each op could have started (its dependencies' last end, or 0)."""
    ready = np.zeros_like(end_s)
    for n, nodes in enumerate(graph.deps):
        if nodes:
            ready[n] = _latest(end_s, nodes)
    return ready
