"""The early flag: a rank its peers wait on, named from step records before the window closes.

Window detectors see a fault once its window closes, and most confirm it over two windows
(15–30 s at the default window). Step records arrive within a producer round (0.5 s) of the
step's end, and each carries the time the rank spent in collectives (``collective_ns``, and
on a CUDA job ``device_collective_ns``, the same on the GPU's clock; the larger of the two is
read: an NCCL call returns on the host at once, so only the device sees its waiting). In
synchronous training every rank ends a step together, so a step that grew grew for everyone;
what tells the ranks apart is the waiting: the peers of a straggler wait in their collectives
for it, the straggler does not (the principle of Holmes, Greyhound and NVIDIA's straggler
scores). Against each rank's own recent collective time (pipeline bubbles and tensor-parallel
waits differ by rank, so ranks are not compared with each other), a step's late ranks are
those whose waiting did not grow with the step.

A rank is flagged when the job's step time rose above the median of the steps before (after
:data:`RECENT_STEPS` steps that were not slow: the flag marks an onset) and stayed there for
:data:`RECENT_STEPS` steps and :data:`MIN_SLOW_S` (a run of slow steps ends after as many
steps that were not), and over its last :data:`LATE_WINDOW_STEPS`
steps the same rank (or a few) was late in most of them while each of its peers waited in most
of them. Judged over the recent steps, not since the run began: on a busy host the peers take
turns being late too, and a run whose first steps were muddled must still be named once its
straggler stands out. A change that does not single out a few ranks (a slow link
slows every member of its ring; sequence imbalance moves from rank to rank; a whole stage; the
job itself) is left to the window detectors, as is any change where the producers do not time
collectives (``collective_ns`` 0): no rank can be named then. The flag is a ``straggler``
finding (detector ``early``); the window's detectors then say why (``diagnosis`` folds the flag
into the explained finding of the same rank).

**A stall** ends no step, so no step record tells who. While a step stays open several times
longer than the rank's recent steps, its PyTorch producer reports how long, and how long the
rank has been waiting in a collective (metrics ``step_open_s`` and ``collective_wait_s``,
:meth:`StepTracker.stall_report`). When most ranks have been waiting for
:data:`STALL_WAIT_S` or more, the few that are not waiting (or not reporting: a frozen
process) hold the job: a ``hang`` finding, raised once per stall.

Why not a window detector: it must run between windows, on step records as they come, with a
few steps of state per rank. All per-rank work is numpy over a ring of the last
:data:`HISTORY_STEPS` steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding, MetricBatch, MetricSample, StepBatch, StepRecord
from trainscope.schemas.step_metric import metrics_by_job, steps_by_job

DETECTOR = "early"
_STALL_METRICS = frozenset({m.STEP_OPEN_S, m.COLLECTIVE_WAIT_S})
_KEPT_METRICS = _STALL_METRICS | {m.PROFILER_BUSY_S}
# A run of slow steps is not flagged on a rank that reported its own profile (trainscope's
# on-demand profile, ``profiler_busy_s``) during the run or this long before it: the run is
# the profile's cost (detectors/own_cost.py), which the flag would otherwise alert.
PROFILE_SLACK_S = 2.0
# Steps kept per job (a ring); a run's baseline is the median of the complete steps before it.
HISTORY_STEPS = 64
# A run of slow steps is flagged once it is this many steps long and lasts MIN_SLOW_S (at
# 1-s steps, 4 s; at 5-ms steps, 200 steps: a short burst of host noise is no straggler),
# after as many steps that were not slow (the run is an onset).
RECENT_STEPS = 4
MIN_SLOW_S = 1.0
# The flagged ranks were late in this share of the run's last LATE_WINDOW_STEPS steps ...
LATE_STEPS_SHARE = 0.75
LATE_WINDOW_STEPS = 16
# ... and each of their peers in at most this share of them (it waited in the others): a
# peer late now and then (preempted on a busy host) does not hide the straggler.
PEER_LATE_SHARE = 0.5
# Complete steps needed before a run of slow steps, for a baseline.
MIN_BASELINE_STEPS = 8
# A step is slow when the job's step time (median over ranks) exceeds the baseline by this
# share and by MIN_EXCESS_NS.
MIN_EXCESS_FRAC = 0.1
MIN_EXCESS_NS = 2_000_000
# ... and by this many robust sigmas of the baseline steps' job step time.
NOISE_Z = 4.0
# The score reaches 1 at this excess (share of the baseline step); the alert threshold (0.5)
# at half of it.
FULL_EXCESS_FRAC = 0.2
# A rank is late in a step when its collective time grew by less than this share of the
# step's excess; its peers are waiting when theirs grew by more.
LATE_SHARE = 0.5
# The late ranks may be at most this share of the job (one rank, a tensor-parallel group):
# more is a stage or the job slowing, which the window detectors tell apart.
MAX_LATE_SHARE = 0.125
# Once flagged, a rank is not flagged again for this many steps: the window's
# detectors carry it from there.
QUIET_STEPS = HISTORY_STEPS
# A stall: most ranks have waited this long in a collective for the few that do not.
STALL_WAIT_S = 3.0
# Stall reports older than this, behind the job's newest, are no longer the rank's state.
STALL_REPORT_FRESH_S = 2.0
# A rank holding the job that has sent no report is called silent (its process may be frozen)
# only once its peers have waited this much longer: its report may just be a round late.
SILENT_GRACE_S = 2.0
# A stall is trainscope's own profile of the ranks holding it (the profiler recording a busy
# Python loop, or condensing its events under the GIL: the rank's sender may say nothing for
# seconds) when each reported its profile during the stall or just before it, and is either
# silent since or reported it within the last STALL_WAIT_S + SILENT_GRACE_S. Not beyond this
# long: a profile holds its rank for seconds, a rank silent for a minute is stuck.
PROFILE_STALL_MAX_S = 60.0


@dataclass
class _SlowRun:
    """Consecutive slow steps from ``first``, against the steps before it."""

    first: int
    cols: np.ndarray  # the job's ranks when it started
    base_step_ns: float
    min_excess_ns: float
    base_wait_ns: np.ndarray  # each rank's collective time per step before the run
    timed: bool  # the producers time collectives (collective_ns not all 0)
    grew_ns: np.ndarray  # per rank: growth of its collective time, summed over the run
    # The last LATE_WINDOW_STEPS steps' late ranks, a row per step.
    late: deque[np.ndarray] = field(default_factory=lambda: deque(maxlen=LATE_WINDOW_STEPS))
    steps: int = 0
    duration_ns: float = 0.0
    excess_ns: list[float] = field(default_factory=list)
    flagged: bool = False
    fast_steps: int = 0  # consecutive steps since the last slow one


def _ring(dtype: type) -> np.ndarray:
    return np.zeros((HISTORY_STEPS, 0), dtype=dtype)


@dataclass
class _Job:
    """The last HISTORY_STEPS steps of one job: row ``step % HISTORY_STEPS`` holds ``step``."""

    step_of_row: np.ndarray = field(
        default_factory=lambda: np.full(HISTORY_STEPS, -1, dtype=np.int64))
    # float32 (ample for ms-scale comparisons): 0.8 MB per 1,000 ranks for the three.
    duration_ns: np.ndarray = field(default_factory=lambda: _ring(np.float32))
    collective_ns: np.ndarray = field(default_factory=lambda: _ring(np.float32))
    # When each rank's step ended, seconds after ``epoch_ns`` (float32: ms over a day).
    end_s: np.ndarray = field(default_factory=lambda: _ring(np.float32))
    epoch_ns: int = 0
    # Each complete step's job step time (median over ranks), by row.
    step_ns: np.ndarray = field(default_factory=lambda: np.zeros(HISTORY_STEPS))
    seen: np.ndarray = field(default_factory=lambda: np.zeros((HISTORY_STEPS, 0), dtype=bool))
    # ``seen`` counted, kept as it changes: by row (ranks that reported the row's step) and by
    # rank (rows it reported), and the ranks with any. A step is complete when its row's count
    # is the active ranks'; reading that off ``seen`` on every poll cost ranks x 64 per poll,
    # 6 s of a 100,000-rank window's 3,125 polls.
    row_seen: np.ndarray = field(default_factory=lambda: np.zeros(HISTORY_STEPS, dtype=np.int64))
    rank_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    active_ranks: int = 0
    checked_through: int = -1  # the newest complete step examined
    quiet_until: dict[int, int] = field(default_factory=dict)  # rank -> step
    # Stall reports: rank -> (ts_ns, step open s, collective wait s), the newest of each.
    stall: dict[int, tuple[int, float, float]] = field(default_factory=dict)
    stall_flagged_at: int = -2  # checked_through when the last stall was flagged
    # rank -> when it last reported its own profile recording or being condensed.
    profiled_ns: dict[int, int] = field(default_factory=dict)
    run: _SlowRun | None = None  # the current run of slow steps, if any

    def end_at_ns(self, row: int, ranks: np.ndarray) -> int:
        """When the step in ``row`` ended: the median over ``ranks`` (a skewed clock aside)."""
        return self.epoch_ns + int(float(np.median(self.end_s[row, ranks])) * 1e9)

    def grow(self, ranks: int, most: int) -> None:
        """Room for ranks ``0..ranks-1`` (at most ``most``). The room grows by doubling: a
        large job's first window brings its ranks a poll at a time, and copying the rings for
        each poll's few hundred new ranks grew as ranks². Columns of ranks not seen yet are
        what a rank that never reported is: not ``seen``."""
        extra = ranks - self.duration_ns.shape[1]
        if extra <= 0:
            return
        extra = max(extra, min(self.duration_ns.shape[1], most - ranks))
        pad = ((0, 0), (0, extra))
        self.duration_ns = np.pad(self.duration_ns, pad)
        self.collective_ns = np.pad(self.collective_ns, pad)
        self.end_s = np.pad(self.end_s, pad)
        self.seen = np.pad(self.seen, pad)
        self.rank_rows = np.pad(self.rank_rows, (0, self.seen.shape[1] - len(self.rank_rows)))

    def clear_rows(self, rows: np.ndarray) -> None:
        """Forget who reported the steps of ``rows`` (a newer step takes them)."""
        lost = self.seen[rows].sum(axis=0)
        had = self.rank_rows > 0
        self.rank_rows -= lost
        self.active_ranks -= int(np.count_nonzero(had & (self.rank_rows == 0)))
        self.row_seen[rows] = 0
        self.seen[rows] = False

    def mark_seen(self, rows: np.ndarray, ranks: np.ndarray) -> None:
        """``ranks`` reported the steps of ``rows`` (pairwise; repeats allowed)."""
        new = ~self.seen[rows, ranks]
        if not new.any():
            return
        width = self.seen.shape[1]
        pairs = np.unique(rows[new] * width + ranks[new])
        new_rows, new_ranks = pairs // width, pairs % width
        self.seen[new_rows, new_ranks] = True
        np.add.at(self.row_seen, new_rows, 1)
        self.active_ranks += len(np.unique(new_ranks[self.rank_rows[new_ranks] == 0]))
        np.add.at(self.rank_rows, new_ranks, 1)


class EarlyWatch:
    """Step records and stall reports in (:meth:`add`, :meth:`add_metrics`), early
    ``straggler`` and ``hang`` findings out (:meth:`check`). ``window_ns`` places a flag in
    the window its step ended in; ``max_ranks`` bounds the state per job (a rank beyond it is
    not watched)."""

    def __init__(self, window_ns: int, max_ranks: int = 1 << 17) -> None:
        self.window_ns = window_ns
        self.max_ranks = max_ranks
        self._jobs: dict[str, _Job] = {}
        self._touched: set[str] = set()

    def add(self, steps: Iterable[StepRecord | StepBatch]) -> None:
        for job_id, batch in steps_by_job(steps).items():
            rank = batch.column("rank").astype(np.int64)
            watched = rank < self.max_ranks
            if not watched.any():
                continue
            job = self._jobs.get(job_id)
            if job is None:
                job = self._jobs[job_id] = _Job()
            self._add_job(job, batch, rank, watched)
            self._touched.add(job_id)

    def _add_job(self, job: _Job, batch: StepBatch, rank: np.ndarray, watched: np.ndarray
                 ) -> None:
        """The batch's steps into the ring, as if taken one by one: a step newer than its
        row's resets the row; one older than the row's, or than the ring, is dropped."""
        job.grow(int(rank[watched].max()) + 1, self.max_ranks)
        step = batch.column("step").astype(np.int64)
        row = step % HISTORY_STEPS
        fresh = watched & (step > job.checked_through - HISTORY_STEPS)
        held = job.step_of_row
        newest = held.copy()
        np.maximum.at(newest, row[fresh], step[fresh])
        reset = newest > held
        end_ns = batch.column("start_ns") + batch.column("duration_ns")
        if not job.epoch_ns:
            first = np.flatnonzero(fresh & (step >= held[row]))
            if len(first):
                job.epoch_ns = int(end_ns[first[0]])
        job.step_of_row = newest
        if reset.any():
            job.clear_rows(np.flatnonzero(reset))
        write = fresh & (step == newest[row])
        rows, ranks = row[write], rank[write]
        job.duration_ns[rows, ranks] = batch.column("duration_ns")[write]
        waited_ns = batch.column("collective_ns")
        if batch.device_collective_ns:
            # Timed on the device too (CUDA): the larger clock saw the waiting. An NCCL call's
            # host time is its launch; a gloo call on CPU tensors queues nothing on the GPU.
            waited_ns = np.maximum(waited_ns, batch.column("device_collective_ns"))
        job.collective_ns[rows, ranks] = waited_ns[write]
        job.end_s[rows, ranks] = (end_ns[write] - job.epoch_ns) / 1e9
        job.mark_seen(rows, ranks)

    def add_metrics(self, samples: Iterable[MetricSample | MetricBatch]) -> None:
        """Keep the stall reports (``step_open_s``, ``collective_wait_s``) and the reports
        of the ranks' own profiles (``profiler_busy_s``) among ``samples``."""
        for job_id, batch in metrics_by_job(samples).items():
            wanted = [i for i, name in enumerate(batch.names) if name in _KEPT_METRICS]
            job = self._jobs.get(job_id)
            if not wanted or job is None:
                continue  # no stall report, or a job with no step record yet to compare with
            name = batch.column("name")
            rank = batch.column("rank")
            rows = np.flatnonzero(np.isin(name, wanted) & (rank >= 0)
                                  & (rank < self.max_ranks))
            for i in rows.tolist():
                metric = batch.names[int(name[i])]
                r, ts_ns = int(rank[i]), int(batch.column("ts_ns")[i])
                if metric == m.PROFILER_BUSY_S:
                    job.profiled_ns[r] = max(ts_ns, job.profiled_ns.get(r, 0))
                else:
                    self._stall_report(job, r, ts_ns, metric, float(batch.column("value")[i]))
            if len(rows):
                self._touched.add(job_id)

    @staticmethod
    def _stall_report(job: _Job, rank: int, ts_ns: int, name: str, value: float) -> None:
        known_ts_ns, open_s, wait_s = job.stall.get(rank, (0, 0.0, 0.0))
        if ts_ns != known_ts_ns:
            open_s, wait_s = 0.0, 0.0
        if name == m.STEP_OPEN_S:
            open_s = value
        else:
            wait_s = value
        job.stall[rank] = (ts_ns, open_s, wait_s)

    def ranks(self, job_id: str) -> np.ndarray:
        """The ranks of ``job_id`` that reported a step still in the ring."""
        job = self._jobs.get(job_id)
        if job is None:
            return np.zeros(0, dtype=np.int64)
        return np.flatnonzero(job.rank_rows > 0)

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)
        self._touched.discard(job_id)

    def check(self) -> list[Finding]:
        """The flags raised by the steps completed since the last check."""
        findings: list[Finding] = []
        for job_id in sorted(self._touched):
            findings += self._check_job(job_id, self._jobs[job_id])
        self._touched.clear()
        return findings

    def _check_job(self, job_id: str, job: _Job) -> list[Finding]:
        # A step is complete when every rank that reported in the ring reported it.
        complete = (job.row_seen == job.active_ranks) & (job.step_of_row >= 0)
        steps = np.sort(job.step_of_row[complete])
        new = steps[steps > job.checked_through]
        if not new.size and not job.stall:
            return []
        active = job.rank_rows > 0
        if new.size:
            # Each new step's job step time (median over the ranks), once.
            rows = new % HISTORY_STEPS
            job.step_ns[rows] = np.median(job.duration_ns[np.ix_(rows, np.flatnonzero(active))],
                                          axis=1)
        findings: list[Finding] = []
        for step in new.tolist():
            finding = self._check_step(job_id, job, int(step), steps, active)
            if finding is not None:
                findings.append(finding)
        if new.size:
            job.checked_through = int(new[-1])
            # Steps end again: reports from before the newest step's end are history.
            row = job.checked_through % HISTORY_STEPS
            ended_ns = job.end_at_ns(row, active)
            job.stall = {rank: report for rank, report in job.stall.items()
                         if report[0] > ended_ns}
        if job.stall:
            finding = self._check_stall(job_id, job, active)
            if finding is not None:
                findings.append(finding)
        return findings

    @staticmethod
    def _own_profile_holds(job: _Job, holding: list[int], fresh: dict[int, object],
                           newest_ns: int, open_s: float) -> bool:
        """Whether the ranks holding the job are held by trainscope's own profile of them
        (see PROFILE_STALL_MAX_S)."""
        if open_s >= PROFILE_STALL_MAX_S:
            return False
        since_ns = newest_ns - (open_s + PROFILE_SLACK_S) * 1e9
        recent_ns = newest_ns - (STALL_WAIT_S + SILENT_GRACE_S) * 1e9
        return all(
            job.profiled_ns.get(r, 0) >= since_ns
            and (r not in fresh or job.profiled_ns[r] >= recent_ns)
            for r in holding
        )

    def _check_stall(self, job_id: str, job: _Job, active: np.ndarray) -> Finding | None:
        if job.stall_flagged_at == job.checked_through:
            return None  # this stall was flagged
        newest_ns = max(ts for ts, _, _ in job.stall.values())
        fresh = {rank: report for rank, report in job.stall.items()
                 if newest_ns - report[0] <= STALL_REPORT_FRESH_S * 1e9}
        ranks = np.flatnonzero(active).tolist()
        waiting = [r for r in ranks if r in fresh and fresh[r][2] >= STALL_WAIT_S]
        if len(waiting) * 2 < len(ranks):
            return None
        holding = [r for r in ranks if r not in waiting]
        if not holding or len(holding) > max(1, int(MAX_LATE_SHARE * len(ranks))):
            return None
        silent = [r for r in holding if r not in fresh]
        open_s = max(report[1] for report in fresh.values())
        wait_s = float(np.median([fresh[r][2] for r in waiting]))
        if silent and wait_s < STALL_WAIT_S + SILENT_GRACE_S:
            return None  # its own report may be a round behind its peers'
        if self._own_profile_holds(job, holding, fresh, newest_ns, open_s):
            return None  # trainscope's cost (detectors/own_cost.py), not a hang
        job.stall_flagged_at = job.checked_through
        who = (f"rank {holding[0]}" if len(holding) == 1
               else f"ranks {', '.join(map(str, holding))}")
        window_start = newest_ns // self.window_ns * self.window_ns
        return Finding(
            job_id=job_id, window_start_ns=window_start,
            window_end_ns=window_start + self.window_ns, detector=DETECTOR,
            rank=holding[0], ranks=holding, victims=waiting, category="hang", score=1.0,
            evidence={"step_open_s": open_s, "peers_waiting_s": round(wait_s, 3),
                      "peers_waiting": float(len(waiting)), "silent": float(len(silent)),
                      "flagged_at_ns": float(newest_ns)},
            message=(
                f"hang: {who} stalled: no step has ended for {open_s:.0f} s (last step "
                f"{job.checked_through}) while {len(waiting)} of {len(ranks)} ranks wait for "
                f"it in collectives ({wait_s:.0f} s)"
                + (f"; {len(silent)} of them report nothing, their process may be frozen"
                   if silent else "")
                + "; flagged from the producers' stall reports, before the window closes"
            ),
        )

    def _check_step(self, job_id: str, job: _Job, step: int, steps: np.ndarray,
                    active: np.ndarray) -> Finding | None:
        """Extend, start or end the job's run of slow steps with ``step``; a flag when the
        run has lasted long enough and singled out the same few ranks."""
        row = step % HISTORY_STEPS
        cols = np.flatnonzero(active)
        run = job.run
        if run is None or run.cols.size != cols.size:
            run = job.run = self._start_run(job, step, steps, cols)
            if run is None:
                return None
        excess_ns = float(job.step_ns[row]) - run.base_step_ns
        if excess_ns < run.min_excess_ns:
            # The run is over after RECENT_STEPS steps that were not slow: the steps an onset
            # needs before it. Not at the first: on a busy host one step of a straggler's run
            # can come in under the bar, and the next slow step, with slow steps just before
            # it, would be no onset; the straggler would never be named.
            run.fast_steps += 1
            if run.fast_steps >= RECENT_STEPS:
                job.run = None
            return None
        run.fast_steps = 0
        # Each rank's waiting against its own before the run: did it grow with the step?
        grew = job.collective_ns[row, cols] - run.base_wait_ns
        run.late.append(grew < LATE_SHARE * excess_ns)
        run.steps += 1
        run.excess_ns.append(excess_ns)
        run.duration_ns += float(job.step_ns[row])
        run.grew_ns += grew
        if run.flagged or run.steps < RECENT_STEPS or run.duration_ns < MIN_SLOW_S * 1e9:
            return None
        culprits = _culprits(np.array(run.late), max(1, int(MAX_LATE_SHARE * cols.size)))
        if not culprits.size or not run.timed:
            return None
        grew_mean = run.grew_ns / run.steps
        culprits = culprits[np.argsort(grew_mean[culprits], kind="stable")]
        ranks = [int(cols[c]) for c in culprits]
        run.flagged = True
        if any(job.quiet_until.get(r, -1) >= step for r in ranks):
            return None
        end_ns = job.end_at_ns(row, cols)
        since_ns = end_ns - run.duration_ns - PROFILE_SLACK_S * 1e9
        if any(job.profiled_ns.get(r, 0) >= since_ns for r in ranks):
            return None  # the rank's own profile: trainscope's cost
        for r in ranks:
            job.quiet_until[r] = step + QUIET_STEPS
        gap_ms = (float(np.median(np.delete(grew_mean, culprits))) - grew_mean[culprits[0]]) / 1e6
        excess_frac = float(np.median(run.excess_ns)) / run.base_step_ns
        step_ms = (run.base_step_ns + float(np.median(run.excess_ns))) / 1e6
        window_start = end_ns // self.window_ns * self.window_ns
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return Finding(
            job_id=job_id, window_start_ns=window_start,
            window_end_ns=window_start + self.window_ns, detector=DETECTOR,
            rank=ranks[0], ranks=ranks, category="straggler",
            score=round(min(1.0, excess_frac / FULL_EXCESS_FRAC), 4),
            evidence={
                "step": float(step), "steps": float(run.steps),
                "step_ms": round(step_ms, 3),
                "baseline_step_ms": round(run.base_step_ns / 1e6, 3),
                "excess_frac": round(excess_frac, 4), "peers_waited_ms": round(gap_ms, 3),
                # When the flagged step ended (job clock): how early the flag came.
                "flagged_at_ns": float(end_ns),
            },
            message=(
                f"straggler: {who} made the peers wait {gap_ms:.0f} ms/step longer in "
                f"collectives for the last {run.steps} steps (steps {run.first}–{step}; step time "
                f"{step_ms:.0f} ms vs {run.base_step_ns / 1e6:.0f} ms before); flagged from step "
                "records, the cause follows at the window close"
            ),
        )

    def _start_run(self, job: _Job, step: int, steps: np.ndarray,
                   cols: np.ndarray) -> _SlowRun | None:
        """A run of slow steps starting at ``step``, against the steps before it; None when
        ``step`` is not slow, or not an onset (the steps just before it were slow too)."""
        before = steps[steps < step][-HISTORY_STEPS + RECENT_STEPS:]
        if before.size < MIN_BASELINE_STEPS:
            return None
        base_rows = before % HISTORY_STEPS
        base_steps_ns = job.step_ns[base_rows]
        base_step_ns = float(np.median(base_steps_ns))
        # Above the job's own step-to-step wobble too (a robust sigma: 1.4826 × MAD); a job
        # whose steps vary widely (uneven sequence lengths) needs a larger rise.
        spread_ns = 1.4826 * float(np.median(np.abs(base_steps_ns - base_step_ns)))
        min_excess_ns = max(MIN_EXCESS_FRAC * base_step_ns, MIN_EXCESS_NS, NOISE_Z * spread_ns)
        if float(job.step_ns[step % HISTORY_STEPS]) - base_step_ns < min_excess_ns:
            return None
        # An onset: the steps just before were not slow. A change older than that is the
        # window detectors' (and by now in the baseline too).
        prior = before[-RECENT_STEPS:]
        if (prior.size < RECENT_STEPS or prior[0] != step - RECENT_STEPS
                or float(np.median(job.step_ns[prior % HISTORY_STEPS])) - base_step_ns
                >= min_excess_ns):
            return None
        waits = job.collective_ns[np.ix_(base_rows, cols)]
        return _SlowRun(first=step, cols=cols, base_step_ns=base_step_ns,
                        min_excess_ns=min_excess_ns,
                        base_wait_ns=np.median(waits, axis=0),
                        timed=bool(waits.any()), grew_ns=np.zeros(cols.size))


def _culprits(late: np.ndarray, max_late: int) -> np.ndarray:
    """The columns late in most of the recent steps (``late``: steps × ranks) while every
    other rank waited in most of them; empty when none, or more than ``max_late`` (a stage,
    the job), or when the others were late as often (ranks taking turns)."""
    share = late.mean(axis=0)
    culprits = np.flatnonzero(share >= LATE_STEPS_SHARE)
    if not 1 <= culprits.size <= max_late:
        return culprits[:0]
    if np.delete(share, culprits).max(initial=0.0) > PEER_LATE_SHARE:
        return culprits[:0]
    return culprits
