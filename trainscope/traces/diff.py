"""Differential calling-context trees: a suspect rank against its peers, or a run against a
baseline run.

Each tree's times are taken per profiler step when every tree knows its steps (so traces of
different lengths compare), else as totals. The baseline of a path is the median over the
peers (a path a peer never ran counts 0 there). The *hot chain* ends at the path with the
largest excess that none of its children explains on its own (no child holds ``share`` of it),
shown with every path above it, e.g.
``<module> → step → ProfilerStep#* → extra_work → <built-in function sleep>``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from trainscope.traces.cct import PathTimes, path_of

DEFAULT_SHARE = 0.8
WAITING_LAYERS = ("collective",)


@dataclass(frozen=True)
class PathDelta:
    callpath_id: int
    path: tuple[tuple[str, str], ...]  # (layer, name) from the root
    value_ns: float  # suspect, per step (or total)
    baseline_ns: float  # median of the peers, same unit
    per_step: bool
    steps: int  # the suspect's steps (0: unknown)

    @property
    def delta_ns(self) -> float:
        return self.value_ns - self.baseline_ns

    @property
    def delta_total_ns(self) -> float:
        """The excess over the whole suspect trace."""
        return self.delta_ns * (self.steps if self.per_step else 1)

    def label(self) -> str:
        return " → ".join(name for _, name in self.path)


def _normalised(times: PathTimes, per_step: bool) -> dict[int, float]:
    return times.per_step() if per_step else {k: float(v) for k, v in times.total_ns.items()}


def diff(suspect: PathTimes, peers: list[PathTimes]) -> dict[int, PathDelta]:
    """Per call path: the suspect's time against the median of its peers."""
    if not peers:
        raise ValueError("a diff needs at least one peer or baseline tree")
    per_step = all(t.steps > 0 for t in (suspect, *peers))
    mine = _normalised(suspect, per_step)
    theirs = [_normalised(p, per_step) for p in peers]
    nodes = dict(suspect.nodes)
    for p in peers:
        nodes.update(p.nodes)
    out: dict[int, PathDelta] = {}
    for cp in set(mine).union(*theirs):
        baseline = statistics.median(t.get(cp, 0.0) for t in theirs)
        out[cp] = PathDelta(cp, tuple(path_of(nodes, cp)), mine.get(cp, 0.0), baseline,
                            per_step, suspect.steps)
    return out


def hot_chain(deltas: dict[int, PathDelta], share: float = DEFAULT_SHARE,
              waiting_layers: tuple[str, ...] = WAITING_LAYERS) -> list[PathDelta]:
    """The root-to-leaf chain of the path with the largest excess that no single child
    explains (no child holds ``share`` of it), with the excess of every path on the way.

    Roots alone do not decide: a peer that waits in a collective for the suspect has as long
    a step as the suspect, so the excess shows only below the step, where the work is. Paths
    through a collective are waiting, not work, and never end the chain (as in the peer-diff
    detector): a victim's longer all-reduce is not where its time went.
    """
    deltas = {cp: d for cp, d in deltas.items()
              if not any(layer in waiting_layers for layer, _ in d.path)}
    by_path = {d.path: d for d in deltas.values()}
    best_child: dict[tuple[tuple[str, str], ...], float] = {}
    for d in deltas.values():
        parent = d.path[:-1]
        best_child[parent] = max(best_child.get(parent, 0.0), d.delta_ns)
    terminals = [d for d in deltas.values()
                 if d.delta_ns > 0 and best_child.get(d.path, 0.0) < share * d.delta_ns]
    if not terminals:
        return []
    best = max(terminals, key=lambda d: d.delta_ns)
    return [by_path[best.path[:i]] for i in range(1, len(best.path) + 1)
            if best.path[:i] in by_path]


def waiting_excess(deltas: dict[int, PathDelta],
                   waiting_layers: tuple[str, ...] = WAITING_LAYERS) -> float:
    """Excess time in collectives (outermost collective paths only): a victim waits longer
    than its peers there, the rank they wait for less."""
    return sum(d.delta_ns for d in deltas.values()
               if d.path and d.path[-1][0] in waiting_layers
               and not any(layer in waiting_layers for layer, _ in d.path[:-1]))


def suspect_score(deltas: dict[int, PathDelta]) -> float:
    """How much a rank looks like the cause: its excess in own work (the hot chain's) less
    its excess in waiting. A victim's own-work excess often sits where it blocks for the
    collective (e.g. inside backward for DDP), but its collectives then take longer too."""
    chain = hot_chain(deltas)
    return (chain[-1].delta_ns if chain else 0.0) - waiting_excess(deltas)

