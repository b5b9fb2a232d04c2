"""Step boundaries and the per-step record.

A step ends at the post-hook of the first optimizer that stepped (the "pacing" optimizer;
with several optimizers per iteration, e.g. a GAN, the others fall inside the step; when it is
garbage-collected the next one to step takes over), or at the end of an explicit
``trainscope.step()`` block once the script uses one.
A step starts where the previous one ended (so data-loading time between iterations belongs to
the step), the very first at the first sign of training activity.
"""

from __future__ import annotations

import weakref
from typing import Any

from trainscope.schemas.records import StepRecord


class StepTracker:
    def __init__(self, job_id: str, rank: int) -> None:
        self.job_id = job_id
        self.rank = rank
        self.step = 0
        self.explicit = False
        self.pacer: weakref.ref[Any] | None = None
        self.start_ns = 0
        self._samples = 0
        self._tokens = 0

    def activity(self, now_ns: int) -> None:
        if not self.start_ns:
            self.start_ns = now_ns

    def add_samples(self, samples: int, tokens: int) -> None:
        self._samples += samples
        self._tokens += tokens

    def end(self, now_ns: int, samples: int | None = None, tokens: int | None = None) -> StepRecord:
        start = self.start_ns or now_ns
        record = StepRecord(
            job_id=self.job_id,
            rank=self.rank,
            step=self.step,
            start_ns=start,
            duration_ns=max(0, now_ns - start),
            samples=self._samples if samples is None else samples,
            tokens=self._tokens if tokens is None else tokens,
        )
        self.step += 1
        self.start_ns = now_ns
        self._samples = 0
        self._tokens = 0
        return record
