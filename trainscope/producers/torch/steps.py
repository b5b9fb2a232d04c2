"""Step boundaries and the per-step record.

A step ends at the post-hook of the first optimizer that stepped (the "pacing" optimizer;
with several optimizers per iteration, e.g. a GAN, the others fall inside the step; when it is
garbage-collected the next one to step takes over), or at the end of an explicit
``trainscope.step()`` block once the script uses one.
A step starts where the previous one ended (so data-loading time between iterations belongs to
the step), the very first at the first sign of training activity.

The training thread only appends a step's five integers to an :class:`~.spanlog.IntLog` (as
the phase logs do for spans); the sender thread builds the :class:`StepRecord` objects
from them. Building a record and taking the outbox's lock on every step cost more than every
other part of the step boundary together.
"""

from __future__ import annotations

import weakref
from typing import Any

from trainscope.producers.torch.spanlog import IntLog
from trainscope.schemas.records import StepRecord

# Integers per step in the log: step, start_ns, duration_ns, samples, tokens.
_FIELDS = 5
# Past this many steps waiting (the sender thread stuck, or gone) the log is cleared and the
# steps counted as dropped, so memory stays bounded.
MAX_PENDING_STEPS = 1 << 18


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
        self.log = IntLog(_FIELDS, MAX_PENDING_STEPS)

    def activity(self, now_ns: int) -> None:
        if not self.start_ns:
            self.start_ns = now_ns

    def add_samples(self, samples: int, tokens: int) -> None:
        self._samples += samples
        self._tokens += tokens

    def end(self, now_ns: int, samples: int | None = None, tokens: int | None = None) -> int:
        """End the step in progress at ``now_ns`` (training thread); returns its number."""
        start = self.start_ns or now_ns
        step = self.step
        self.log.values.extend((
            step,
            start,
            now_ns - start if now_ns > start else 0,
            self._samples if samples is None else samples,
            self._tokens if tokens is None else tokens,
        ))
        self.step = step + 1
        self.start_ns = now_ns
        self._samples = 0
        self._tokens = 0
        return step

    def drain(self) -> list[StepRecord]:
        """The records of the steps ended since the last drain (sender thread)."""
        values = self.log.take().tolist()
        job_id, rank = self.job_id, self.rank
        return [
            StepRecord(job_id=job_id, rank=rank, step=values[i], start_ns=values[i + 1],
                       duration_ns=values[i + 2], samples=values[i + 3], tokens=values[i + 4])
            for i in range(0, len(values), _FIELDS)
        ]
