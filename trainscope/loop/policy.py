"""Which findings make the stream job profile a rank, and which peer it profiles beside it.

The rule, per closed window of one job:

- only findings at or above the alert threshold that name one rank count (a job-level or
  stage-level finding has no rank to profile), and not hangs (a hung rank takes no steps, so a
  profile of it would never finish); of several findings on one rank, the strongest;
- a job of one rank has no peer to compare with: nothing is asked;
- the peer is a rank that no alert of the window names as suspect or victim, preferably of the
  suspect's pipeline stage and tensor-parallel rank (it runs the same code), else the nearest
  rank; if every rank is named, the nearest one that is not itself a suspect;
- at most one request per (job, suspect rank) every ``every_s`` seconds, and at most
  ``max_pending`` sessions waiting for their profiles across all jobs (the fleet's budget);
- a profile that caught its suspect waiting for its peer rather than holding it is asked for
  once more, longer (``retry_steps``);
- a straggler that is slow only now and then (a stall every 20 steps, a periodic checkpoint)
  is profiled for long enough to hold two of its slow steps, read from the window's step
  records of the suspect (a step over twice the rank's median is slow), up to
  ``MAX_COVER_STEPS``: a profile of 5 steps between two stalls finds nothing (``cover_steps``).

A healthy job has no alert, so it is never profiled. The policy only decides; it publishes
nothing and keeps only the times of its last requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_EVERY_S = 600.0
DEFAULT_MAX_PENDING = 4
# A hung rank steps no more: a profile of it would never arrive. Too many function names
# (cardinality) is about the telemetry, not the rank's speed: a profile would not tell more;
# nor about a wrong host clock (clock-skew). A rank that never reported (no-data) has no
# producer running to profile it.
NOT_PROFILED = frozenset({"hang", "no-data", "cardinality", "clock-skew"})
# The longest profile asked for to catch intermittent slow steps (the PyTorch producer's own
# cap, TRAINSCOPE_PROFILE_MAX_STEPS, is 50 by default; its time budget bounds it too).
MAX_COVER_STEPS = 50
# A step this many times the rank's median step in the window is one of its slow steps.
SLOW_STEP_RATIO = 2.0
# Slow steps a profile of an intermittent straggler should hold.
COVERED_SLOW_STEPS = 2
# A profile that did not catch its suspect holding the job is asked for once more, this many
# times as long (at least RETRY_MIN_STEPS, at most MAX_COVER_STEPS): more steps dilute the
# profiles' start and hold more of a fault that comes and goes.
RETRY_STEPS_FACTOR = 4
RETRY_MIN_STEPS = 20


@dataclass(frozen=True)
class ProfilePlan:
    finding: Finding
    suspect: int
    peer: int
    # Steps to profile so that the suspect's intermittent slow steps are in it (0: as many as
    # the loop asks for by default).
    cover_steps: int = 0


@dataclass
class PolicyCounts:
    planned: int = 0
    skipped_rate: int = 0  # asked about this (job, rank) less than every_s ago
    skipped_fleet: int = 0  # max_pending sessions already waiting
    skipped_no_peer: int = 0


@dataclass
class ProfilePolicy:
    threshold: float = ALERT_THRESHOLD
    every_s: float = DEFAULT_EVERY_S
    max_pending: int = DEFAULT_MAX_PENDING
    clock: Callable[[], float] = time.monotonic
    counts: PolicyCounts = field(default_factory=PolicyCounts)
    _last: dict[tuple[str, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.every_s < 0 or self.max_pending < 1:
            raise ValueError(f"every_s must be >= 0 and max_pending >= 1, got {self.every_s} "
                             f"and {self.max_pending}")

    def decide(self, view: WindowView, findings: list[Finding], pending: int) -> list[ProfilePlan]:
        """The profiles to ask for after this window; ``pending``: sessions still awaited."""
        alerts = [f for f in findings if f.score >= self.threshold]
        strongest: dict[int, Finding] = {}
        for f in alerts:
            if f.rank >= 0 and f.category not in NOT_PROFILED and (
                f.rank not in strongest or f.score > strongest[f.rank].score
            ):
                strongest[f.rank] = f
        if not strongest:
            return []
        layout = view.rank_layout()
        ranks = sorted(int(r) for r in layout.index)
        named = {r for f in alerts for r in (f.rank, *f.ranks, *f.victims) if r >= 0}
        plans: list[ProfilePlan] = []
        now = self.clock()
        for rank, finding in sorted(strongest.items(), key=lambda kv: -kv[1].score):
            key = (view.job_id, rank)
            last = self._last.get(key)
            if last is not None and now - last < self.every_s:
                self.counts.skipped_rate += 1
                continue
            if pending + len(plans) >= self.max_pending:
                self.counts.skipped_fleet += 1
                continue
            peer = _peer(rank, ranks, named, set(strongest), layout)
            if peer is None:
                self.counts.skipped_no_peer += 1
                continue
            self._last[key] = now
            self.counts.planned += 1
            plans.append(ProfilePlan(finding, rank, peer, cover_steps(view.steps, rank)))
        return plans

    def forget(self, job_id: str) -> None:
        for key in [k for k in self._last if k[0] == job_id]:
            del self._last[key]


def cover_steps(steps: pd.DataFrame, rank: int) -> int:
    """Steps a profile of ``rank`` needs to hold about two of its slow steps in this window's
    step records (``duration_ns`` over twice its median), at most ``MAX_COVER_STEPS``; 0 when
    none or most of its steps are slow (any profile holds them)."""
    if steps.empty:
        return 0
    durations = steps.loc[steps["rank"] == rank, "duration_ns"].to_numpy(dtype=float)
    if len(durations) < 2:
        return 0
    slow = int((durations > SLOW_STEP_RATIO * float(np.median(durations))).sum())
    if not slow:
        return 0
    return min(MAX_COVER_STEPS, math.ceil(COVERED_SLOW_STEPS * len(durations) / slow))


def retry_steps(steps: int) -> int:
    """The steps to ask for again after a profile of ``steps`` that did not catch its
    suspect holding the job."""
    return max(steps, min(MAX_COVER_STEPS, max(RETRY_MIN_STEPS, RETRY_STEPS_FACTOR * steps)))


def _peer(suspect: int, ranks: list[int], named: set[int], suspects: set[int],
          layout: pd.DataFrame) -> int | None:
    others = [r for r in ranks if r != suspect]
    healthy = [r for r in others if r not in named] or [r for r in others if r not in suspects]
    if not healthy:
        return None
    where = layout.loc[suspect] if suspect in layout.index else None

    def closeness(rank: int) -> tuple[int, int]:
        same = (where is not None and layout.loc[rank, "pp_stage"] == where["pp_stage"]
                and layout.loc[rank, "tp_rank"] == where["tp_rank"])
        return (0 if same else 1, abs(rank - suspect))

    return min(healthy, key=closeness)
