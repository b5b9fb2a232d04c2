"""What the window engine keeps per job: its open windows' input, its functions, its progress.

Plain data, shared by the engine (:mod:`trainscope.engine.windows`), its watermarks
(:mod:`trainscope.engine.watermarks`) and its snapshots (:mod:`trainscope.engine.snapshot`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from trainscope.engine.clocks import RankClocks
from trainscope.engine.keys import FunctionTable
from trainscope.schemas.grouping import Partials
from trainscope.schemas.records import MetricBatch, StepBatch, Topology

# A window index or event time before any real one: "nothing closed yet", "no watermark yet".
FAR_PAST = -(2**62)


class RankProgress:
    """One source's ranks of a job: each one's latest event time and the processing time it
    came, as arrays (slot by rank), so that what the ranks agree on is one ``np.partition``
    in C; a sort of Python tuples per poll over every rank grew as ranks² over a window."""

    __slots__ = ("latest_ns", "seen_s", "size", "slots")

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}  # rank -> its index in the arrays
        self.latest_ns = np.empty(0, dtype=np.int64)
        self.seen_s = np.empty(0, dtype=np.float64)
        self.size = 0

    def update(self, ranks: np.ndarray, newest_ns: np.ndarray, now_s: float) -> None:
        """Each of ``ranks`` (distinct) delivered up to ``newest_ns`` at ``now_s``."""
        slots = self.slots
        rank_list = ranks.tolist()
        index = [slots.get(rank, -1) for rank in rank_list]
        if -1 in index:
            for j, rank in enumerate(rank_list):
                if index[j] < 0:
                    index[j] = slots[rank] = self.size
                    self.size += 1
            if self.size > len(self.latest_ns):
                capacity = max(16, 2 * self.size)
                grown = np.full(capacity, np.iinfo(np.int64).min, dtype=np.int64)
                grown[: len(self.latest_ns)] = self.latest_ns
                seen = np.zeros(capacity, dtype=np.float64)
                seen[: len(self.seen_s)] = self.seen_s
                self.latest_ns, self.seen_s = grown, seen
        at = np.asarray(index, dtype=np.intp)
        self.latest_ns[at] = np.maximum(self.latest_ns[at], newest_ns)
        self.seen_s[at] = now_s

    def agreed_ns(self, now_s: float, idle_s: float) -> int | None:
        """The lower median of the latest event times of ranks heard from within ``idle_s``;
        the newest of all when none was; ``None`` with no rank."""
        if not self.size:
            return None
        latest = self.latest_ns[: self.size]
        active = latest[now_s - self.seen_s[: self.size] < idle_s]
        if not len(active):
            return int(latest.max())
        k = (len(active) - 1) // 2
        return int(np.partition(active, k)[k])


@dataclass
class OpenWindow:
    """A window's input as it arrived; partials are merged only when the window closes."""

    partials: list[Partials] = field(default_factory=list)
    steps: list[StepBatch] = field(default_factory=list)
    metrics: list[MetricBatch] = field(default_factory=list)


@dataclass
class JobState:
    base: int | None = None  # window index the job's group keys count from (keys.WINDOW_MARGIN)
    progress_ns: dict[Hashable, int] = field(default_factory=dict)  # per source
    # per source, per rank: latest event time, processing time it came; see watermarks
    rank_progress: dict[Hashable, RankProgress] = field(default_factory=dict)
    last_arrival_s: float = 0.0  # processing time
    first_seen_s: float = 0.0  # processing time this engine started (or restored) the job
    closed_before: int = FAR_PAST  # window index: every window below it is closed
    restored_before: int = FAR_PAST  # window index: written by a previous run
    reported_late: bool = False
    functions: FunctionTable = field(default_factory=FunctionTable)
    windows: dict[int, OpenWindow] = field(default_factory=dict)
    topology: Topology | None = None
    clocks: RankClocks = field(default_factory=RankClocks)  # per-rank clock offsets

    def window(self, index: int) -> OpenWindow:
        """The open window ``index``, opened if it is not yet."""
        window = self.windows.get(index)
        if window is None:
            window = self.windows[index] = OpenWindow()
        return window
