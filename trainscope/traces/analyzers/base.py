"""What every analyzer shares: the suggestion it returns and a view of one rank's trace.

An analyzer is a small object with a ``name`` and ``analyze(view) -> list[Suggestion]``: one
rule, its thresholds as constructor arguments, no state. A suggestion says what was found,
with figures, what to try, where in the code (the call path of the largest contributor), and
the time at stake: what the rank would save at most if the cause went away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from trainscope.traces.cct import CallTree, path_of
from trainscope.traces.classes import CLASS_INDEX
from trainscope.traces.reader import Trace


@dataclass(frozen=True)
class Suggestion:
    analyzer: str
    rank: int
    at_stake_ns: int
    found: str
    advice: str
    where: str = ""
    evidence: dict[str, float] = field(default_factory=dict)


class Analyzer(Protocol):
    name: str

    def analyze(self, view: TraceView) -> list[Suggestion]: ...


def union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted intervals covering the given ones."""
    if not len(starts):
        return starts.astype(np.int64), ends.astype(np.int64)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    # An interval ends where the next one starts a new group; its end is the reach so far.
    last = np.flatnonzero(np.r_[new[1:], True])
    return s[new], reach[last]


def overlap_ns(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> int:
    """Total length of the intersection of two disjoint sorted interval sets."""
    i = j = 0
    total = 0
    a_s, a_e, b_s, b_e = (x.tolist() for x in (*a, *b))
    while i < len(a_s) and j < len(b_s):
        lo, hi = max(a_s[i], b_s[j]), min(a_e[i], b_e[j])
        if hi > lo:
            total += hi - lo
        if a_e[i] < b_e[j]:
            i += 1
        else:
            j += 1
    return total


class TraceView:
    """One rank's trace with its call tree, and the figures several analyzers use."""

    def __init__(self, trace: Trace, tree: CallTree, steps: int = 0) -> None:
        self.trace, self.tree, self.steps = trace, tree, steps
        self._ops: dict[int, str] = {}  # call path → launching op (many events share a path)

    def of(self, *classes: str) -> np.ndarray:
        return np.isin(self.trace.cls, [CLASS_INDEX[c] for c in classes])

    def name(self, i: int) -> str:
        return self.trace.names[int(self.trace.name_id[i])]

    def where(self, i: int) -> str:
        return " → ".join(n for _, n in path_of(self.tree.nodes, int(self.tree.callpath[i])))

    @cached_property
    def device(self) -> np.ndarray:
        return self.of("kernel", "gpu_memcpy", "gpu_memset")

    @cached_property
    def device_busy(self) -> tuple[np.ndarray, np.ndarray]:
        t = self.trace
        return union(t.start_ns[self.device], t.start_ns[self.device] + t.dur_ns[self.device])

    @cached_property
    def device_span_ns(self) -> int:
        s, e = self.device_busy
        return int(e[-1] - s[0]) if len(s) else 0

    @cached_property
    def step_ns(self) -> int:
        """Time of the profiled steps (ProfilerStep annotations), else of the whole trace."""
        t = self.trace
        steps = [i for i in np.flatnonzero(self.of("user_annotation")).tolist()
                 if self.name(i).startswith("ProfilerStep#")]
        if steps:
            return int(t.dur_ns[steps].sum())
        if not len(t):
            return 0
        return int((t.start_ns + t.dur_ns).max() - t.start_ns.min())

    def launching_op(self, i: int) -> str:
        """The innermost framework op above event ``i``, else its innermost annotation."""
        cp = int(self.tree.callpath[i])
        found = self._ops.get(cp)
        if found is None:
            path = path_of(self.tree.nodes, cp)
            found = next((name for layer, name in reversed(path)
                          if layer in ("torch_op", "collective", "user_annotation")),
                         path[0][1] if path else "")
            self._ops[cp] = found
        return found
