"""Differential calling-context trees: a suspect rank against its peers, or a run against a
baseline run.

Each tree's times are taken per profiler step when every tree knows its steps (so traces of
different lengths compare), else as totals. The baseline of a path is the median over the
peers (a path a peer never ran counts 0 there). The *hot chain* ends at the path with the
largest excess that none of its children explains on its own (no child holds more than
``share`` of it, by default most of it), shown with every path above it, e.g.
``<module> → step → ProfilerStep#* → extra_work → <built-in function sleep>``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from trainscope.traces.cct import PathTimes, path_of

# A child that holds most of its parent's excess is where the excess went: a suspect on a busy
# host also loses time to the scheduler all over its loop (a CI run: +49 ms/step under the
# loop, +31 ms of it in the one slow block, the rest spread thin), and a stricter share would
# end the chain at the loop, which names nothing.
DEFAULT_SHARE = 0.5
WAITING_LAYERS = ("collective",)
# Python frames of torch.distributed's collective calls: a rank blocked in a synchronous
# ``dist.broadcast`` or ``all_reduce`` waits there (in ``work.wait()``, a Python-layer
# built-in), whether or not a collective-layer event sits under the frame. The decorator
# torch puts on each of them (``c10d_logger``) and the producer's own timing wrapper around
# them are the same call; a frame's file may be named by its full path.
WAITING_FRAMES = ("torch/distributed/distributed_c10d.py(", "torch/distributed/c10d_logger.py(",
                  "trainscope/producers/torch/collectives.py(")


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
    explains (no child holds more than ``share`` of it), with the excess of every path on the
    way. Two children with equal shares of it explain it no more than one another: the chain
    ends above them.

    Roots alone do not decide: a peer that waits in a collective for the suspect has as long
    a step as the suspect, so the excess shows only below the step, where the work is. Paths
    through a collective are waiting, not work, and never end the chain (as in the peer-diff
    detector): a victim's longer all-reduce is not where its time went; nor does the paths'
    waiting count in the excess of the paths above them (a frame that ran a blocking
    ``dist.broadcast`` is not slow for the time it waited there).
    """
    waiting = {cp: d for cp, d in deltas.items() if _waits(d.path, waiting_layers)}
    deltas = {cp: d for cp, d in deltas.items() if cp not in waiting}
    by_path = {d.path: d for d in deltas.values()}
    # Each outermost waiting path's time taken off every path above it.
    waited: dict[tuple[tuple[str, str], ...], tuple[float, float]] = {}
    for d in waiting.values():
        if _waits(d.path[:-1], waiting_layers):
            continue
        for i in range(1, len(d.path)):
            value, base = waited.get(d.path[:i], (0.0, 0.0))
            waited[d.path[:i]] = (value + d.value_ns, base + d.baseline_ns)
    for path, (value, base) in waited.items():
        if path in by_path:
            d = by_path[path]
            by_path[path] = deltas[d.callpath_id] = replace(
                d, value_ns=d.value_ns - value, baseline_ns=d.baseline_ns - base)
    best_child: dict[tuple[tuple[str, str], ...], float] = {}
    for d in deltas.values():
        parent = d.path[:-1]
        best_child[parent] = max(best_child.get(parent, 0.0), d.delta_ns)
    terminals = [d for d in deltas.values()
                 if d.delta_ns > 0 and best_child.get(d.path, 0.0) <= share * d.delta_ns]
    if not terminals:
        return []
    best = max(terminals, key=lambda d: d.delta_ns)
    return [by_path[best.path[:i]] for i in range(1, len(best.path) + 1)
            if best.path[:i] in by_path]


def _waits(path: tuple[tuple[str, str], ...], waiting_layers: tuple[str, ...]) -> bool:
    """Whether the path passes through a collective (its layer or a torch.distributed
    frame)."""
    return any(layer in waiting_layers
               or (layer == "python" and any(frame in name for frame in WAITING_FRAMES))
               for layer, name in path)


def waiting_excess(deltas: dict[int, PathDelta],
                   waiting_layers: tuple[str, ...] = WAITING_LAYERS) -> float:
    """Excess time in collectives (outermost collective paths only): a victim waits longer
    than its peers there, the rank they wait for less. Collective events only, not the
    Python frames of a blocking call that :func:`hot_chain` also sets aside: every collective
    of the job has its events in both ranks' profiles, a Python call only where a rank made
    it (a rank waiting in a periodic ``dist.broadcast`` for its profiled peer is no victim
    of the job's steps)."""
    return sum(d.delta_ns for d in deltas.values()
               if d.path and d.path[-1][0] in waiting_layers
               and not any(layer in waiting_layers for layer, _ in d.path[:-1]))


def suspect_score(deltas: dict[int, PathDelta]) -> float:
    """How much a rank looks like the cause: its excess in own work (the hot chain's) less
    its excess in waiting. A victim's own-work excess often sits where it blocks for the
    collective (e.g. inside backward for DDP), but its collectives then take longer too."""
    chain = hot_chain(deltas)
    return (chain[-1].delta_ns if chain else 0.0) - waiting_excess(deltas)

