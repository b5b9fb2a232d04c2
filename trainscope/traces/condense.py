"""One rank's trace condensed into what the store holds: function summaries per window (one
per layer, name and call path), step records (``ProfilerStep#N``), and the calling-context
tree per window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas.records import StepRecord, SummaryBatch
from trainscope.schemas.summaries import FunctionKey, summary_batches
from trainscope.traces.cct import CallTree, PathTimes, build, path_times
from trainscope.traces.classes import CLASS_INDEX
from trainscope.traces.reader import Trace

_STEP = re.compile(r"^ProfilerStep#(\d+)$")


@dataclass
class Condensed:
    rank: int
    summaries: list[SummaryBatch] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    # window start → the calling-context tree of the events that started in it
    windows: dict[int, PathTimes] = field(default_factory=dict)
    tree: CallTree | None = None
    events: int = 0

    def whole(self) -> PathTimes:
        """The tree over the whole trace (all windows merged)."""
        out: PathTimes | None = None
        for times in self.windows.values():
            out = times if out is None else out.merged(times)
        if out is None:
            return PathTimes({}, {}, {}, {}, len(self.steps))
        out.steps = len(self.steps)
        return out


def step_records(trace: Trace, job_id: str) -> list[StepRecord]:
    annotation = trace.cls == CLASS_INDEX["user_annotation"]
    out = []
    for i in np.flatnonzero(annotation).tolist():
        match = _STEP.match(trace.names[int(trace.name_id[i])])
        if match:
            out.append(StepRecord(job_id=job_id, rank=trace.rank, step=int(match.group(1)),
                                  start_ns=int(trace.start_ns[i]),
                                  duration_ns=int(trace.dur_ns[i])))
    return sorted(out, key=lambda r: r.step)


def condense(trace: Trace, job_id: str, window_ns: int) -> Condensed:
    tree = build(trace)
    out = Condensed(rank=trace.rank, tree=tree, events=len(trace))
    out.steps = step_records(trace, job_id)
    if not len(trace):
        return out
    window = trace.start_ns // window_ns * window_ns
    # One sort groups the events by window, call path and name; each group's durations go
    # to the summary builder as a numpy slice (no per-event Python objects).
    order = np.lexsort((trace.name_id, tree.callpath, window))
    w_sorted, cp_sorted = window[order], tree.callpath[order]
    name_sorted, dur_sorted = trace.name_id[order], trace.dur_ns[order]
    bytes_sorted, layer_sorted = trace.bytes_moved[order], tree.layer_id[order]
    change = np.ones(len(order), dtype=bool)
    change[1:] = ((w_sorted[1:] != w_sorted[:-1]) | (cp_sorted[1:] != cp_sorted[:-1])
                  | (name_sorted[1:] != name_sorted[:-1]))
    starts = np.flatnonzero(change)
    bounds = np.r_[starts, len(order)]
    moved_per_group = np.add.reduceat(bytes_sorted, starts)
    by_window: dict[int, tuple[dict[FunctionKey, np.ndarray], dict[FunctionKey, int]]] = {}
    for k, lo in enumerate(starts.tolist()):
        hi = int(bounds[k + 1])
        key = (tree.layer_names[int(layer_sorted[lo])], trace.names[int(name_sorted[lo])],
               int(cp_sorted[lo]))
        durations, moved = by_window.setdefault(int(w_sorted[lo]), ({}, {}))
        durations[key] = dur_sorted[lo:hi]
        if moved_per_group[k]:
            moved[key] = int(moved_per_group[k])
    for w, (durations, moved) in sorted(by_window.items()):
        out.summaries.extend(summary_batches(
            durations, job_id=job_id, rank=trace.rank, window_start_ns=w,
            window_end_ns=w + window_ns, bytes_total=moved,
        ))
        steps_in = sum(1 for s in out.steps if s.start_ns // window_ns * window_ns == w)
        out.windows[w] = path_times(tree, trace, steps_in, window == w)
    return out
