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


# What the ranks agree on is taken again once this share of them delivered since, or this long
# after (processing time: a rank falling idle counts as idle that much later), or at once when
# a rank is new or back from idle. In between, ranks only move forward, so the value kept is
# at most the true one: a window closes a little later, not early. Taken on every poll, the
# partition over every rank was the largest cost of a 100,000-rank job's polls.
AGREED_STALE_SHARE = 1 / 64
AGREED_REFRESH_S = 0.5


class RankProgress:
    """One source's ranks of a job: each one's latest event time and the processing time it
    came, as arrays (slot by rank), so that what the ranks agree on is one ``np.partition``
    in C; a sort of Python tuples per poll over every rank grew as ranks² over a window."""

    __slots__ = (
        "_agreed",
        "_agreed_at_s",
        "_longest_gap_s",
        "_moved_since",
        "latest_ns",
        "seen_s",
        "size",
        "slots",
    )

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}  # rank -> its index in the arrays
        self.latest_ns = np.empty(0, dtype=np.int64)
        self.seen_s = np.empty(0, dtype=np.float64)
        self.size = 0
        self._forget_agreed()

    def _forget_agreed(self) -> None:
        # (value, idle_s it was taken with) of agreed_ns; None: take it again.
        self._agreed: tuple[int, float] | None = None
        self._agreed_at_s = 0.0
        self._moved_since = 0  # ranks that delivered since it was taken
        self._longest_gap_s = 0.0  # the longest silence those ranks broke

    def __getstate__(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in ("latest_ns", "seen_s", "size", "slots")}

    def __setstate__(self, state: object) -> None:
        # A plain dict, or (None, slots) as pickle gave the slots of an older version.
        values = state[1] if isinstance(state, tuple) else state
        for name, value in values.items():  # type: ignore[union-attr]
            setattr(self, name, value)
        self._forget_agreed()

    def update(self, ranks: np.ndarray, newest_ns: np.ndarray, now_s: float) -> None:
        """Each of ``ranks`` (distinct) delivered up to ``newest_ns`` at ``now_s``."""
        slots = self.slots
        rank_list = ranks.tolist()
        index = [slots.get(rank, -1) for rank in rank_list]
        if -1 in index:
            self._agreed = None
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
        if self._agreed is not None and len(at):
            self._moved_since += len(at)
            self._longest_gap_s = max(self._longest_gap_s, now_s - float(self.seen_s[at].min()))
        self.seen_s[at] = now_s

    def agreed_ns(self, now_s: float, idle_s: float) -> int | None:
        """The lower median of the latest event times of ranks heard from within ``idle_s``;
        the newest of all when none was; ``None`` with no rank."""
        if not self.size:
            return None
        kept = self._agreed
        if (kept is not None and kept[1] == idle_s
                and self._moved_since < AGREED_STALE_SHARE * self.size
                and self._longest_gap_s < idle_s
                and 0.0 <= now_s - self._agreed_at_s < min(AGREED_REFRESH_S, idle_s)):
            return kept[0]
        latest = self.latest_ns[: self.size]
        active = latest[now_s - self.seen_s[: self.size] < idle_s]
        if not len(active):
            agreed = int(latest.max())
        else:
            k = (len(active) - 1) // 2
            agreed = int(np.partition(active, k)[k])
        self._agreed = (agreed, idle_s)
        self._agreed_at_s, self._moved_since, self._longest_gap_s = now_s, 0, 0.0
        return agreed


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
