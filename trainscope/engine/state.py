"""What the window engine keeps per job: its open windows' input, its functions, its progress.

Plain data, shared by the engine (:mod:`trainscope.engine.windows`), its watermarks
(:mod:`trainscope.engine.watermarks`) and its snapshots (:mod:`trainscope.engine.snapshot`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from trainscope.engine.clocks import RankClocks
from trainscope.engine.keys import FunctionTable
from trainscope.schemas.grouping import Partials
from trainscope.schemas.records import MetricBatch, StepBatch, Topology

# A window index or event time before any real one: "nothing closed yet", "no watermark yet".
FAR_PAST = -(2**62)


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
    # per source, per rank: (latest event time, processing time it came); see watermarks
    rank_progress: dict[Hashable, dict[int, tuple[int, float]]] = field(default_factory=dict)
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
