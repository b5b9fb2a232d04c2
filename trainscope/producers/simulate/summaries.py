"""Condensing the simulated ranks' spans per window, as every real producer does before sending.

Each simulated rank gets the :class:`~trainscope.schemas.recorder.WindowRecorder` that
``attach()`` runs in a real rank: its spans are added one by one, a window is condensed into
:class:`SummaryBatch` records once the rank's clock is past its end plus the grace period, and
whatever is still open is condensed when the job ends. So the simulator sends what production
sends, made by the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from trainscope.schemas.recorder import WindowRecorder
from trainscope.schemas.records import SpanBatch, StepRecord, SummaryBatch


class RankRecorders:
    """One window recorder per simulated rank."""

    def __init__(self, job_id: str, world_size: int, window_s: float) -> None:
        self.job_id = job_id
        self.recorders = [WindowRecorder.for_window(window_s) for _ in range(world_size)]

    def steps_started(self, steps: Sequence[StepRecord]) -> None:
        """Each rank's step began: its spans from then on go to the step's window."""
        for step in steps:
            self.recorders[step.rank].step_started(step.start_ns)

    def add(self, batches: Sequence[SpanBatch]) -> None:
        recorders = self.recorders
        for batch in batches:
            layers, names = batch.layers, batch.names
            for rank, fn, start, duration, moved in zip(
                batch.column("rank").tolist(),
                batch.column("fn").tolist(),
                batch.column("start_ns").tolist(),
                batch.column("duration_ns").tolist(),
                batch.column("bytes_moved").tolist(),
                strict=True,
            ):
                recorders[rank].add(layers[fn], names[fn], start, duration, moved)

    def closed(self, now_ns: np.ndarray) -> list[SummaryBatch]:
        """Summaries of the windows each rank closes at its own clock ``now_ns[rank]``."""
        out: list[SummaryBatch] = []
        for rank, recorder in enumerate(self.recorders):
            for window_start, functions in recorder.take_closed(int(now_ns[rank])):
                out += recorder.summaries(self.job_id, rank, window_start, functions)
        return out

    def flush(self) -> list[SummaryBatch]:
        """Summaries of every window still open: the job ended."""
        out: list[SummaryBatch] = []
        for rank, recorder in enumerate(self.recorders):
            for window_start, functions in recorder.take_all():
                out += recorder.summaries(self.job_id, rank, window_start, functions)
        return out
