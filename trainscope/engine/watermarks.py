"""Event time per job: each source's progress, and the watermark that closes the job's windows.

Every *source* that carries a job (a Kafka partition, or the one source of records handed over
directly) has its own progress for that job: the latest event time it delivered. The watermark
is the progress of the slowest *active* source minus the allowed lateness, so a partition that is
read later than the others delays the job's windows instead of turning its events late. A source
is idle once it has delivered nothing for ``source_idle_s`` of processing time (caught up, or all
its producers silent); idle sources stop holding windows open, so a hung rank (whose partition
also carries live ranks, or goes quiet) never stops the job. For its first ``source_idle_s``, a
job's windows are also held by every busy source that has not delivered its records yet: which
sources carry a job is learnt, not declared, and one whose reader lags (a partition fetched
late, a worker that forwards it started late) would otherwise not count until its first record
of the job came, late.

Within a source, progress is kept per rank, and the source's progress is what its active ranks
agree on: the lower median of their latest event times, never the fastest. One rank whose clock
runs ahead (or whose clock offset is still being estimated, :mod:`trainscope.engine.clocks`)
then cannot drag the job's watermark past its peers' records and turn them late; a rank behind
still holds its own records' windows open, as a slow source does. While a job holds records
whose ranks' clock offsets are not known yet, none of its windows closes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from trainscope.engine.state import FAR_PAST, JobState, RankProgress


class Watermarks:
    """The sources' last deliveries (processing time) and the jobs' watermarks from them."""

    def __init__(
        self, lateness_ns: int, source_idle_s: float, clock: Callable[[], float]
    ) -> None:
        self.lateness_ns = lateness_ns
        self.source_idle_s = source_idle_s
        self._clock = clock
        self._source_seen_s: dict[Hashable, float] = {}
        self._expected_s: dict[Hashable, float] = {}  # sources assigned, not heard from yet

    def observe(self, job: JobState, source: Hashable,
                progress_ns: tuple[np.ndarray, np.ndarray]) -> None:
        """Advance the progress of each rank on ``source`` to its latest event time
        (``progress_ns``: distinct ranks, and each one's latest event time in ns)."""
        ranks, newest_ns = progress_ns
        if not len(ranks):
            return
        now = self._clock()
        self._source_seen_s[source] = now
        job.last_arrival_s = now
        progress = job.rank_progress.get(source)
        if progress is None:
            progress = job.rank_progress[source] = RankProgress()
        progress.update(ranks, newest_ns, now)
        newest = int(newest_ns.max())
        known_ns = job.progress_ns.get(source)
        if known_ns is None or newest > known_ns:
            job.progress_ns[source] = newest

    def _agreed_ns(self, job: JobState, source: Hashable, now: float) -> int:
        """The source's progress: the lower median of its active ranks' (see the module
        docstring); its newest event time when it has none."""
        progress = job.rank_progress.get(source)
        agreed = None if progress is None else progress.agreed_ns(now, self.source_idle_s)
        return job.progress_ns[source] if agreed is None else agreed

    def expect_sources(self, sources: list[Hashable]) -> None:
        """Sources (partitions) just assigned: until one delivers or has been silent for
        ``source_idle_s``, it may carry any job's oldest records, so it holds every window."""
        now = self._clock()
        for source in sources:
            if source not in self._source_seen_s:
                self._expected_s.setdefault(source, now)

    def watermark_ns(self, job: JobState | None) -> int:
        if job is None or not job.progress_ns or job.clocks.held:
            return FAR_PAST
        now = self._clock()
        if self._expected_s:
            for source in [s for s in self._expected_s if s in self._source_seen_s]:
                del self._expected_s[source]
            if any(now - since < self.source_idle_s for since in self._expected_s.values()):
                return FAR_PAST
        if now - job.first_seen_s < self.source_idle_s:
            # A new job: a source that is busy but has not delivered this job's records yet
            # may still carry its oldest ones (its reader lags, or they come another way, as
            # metrics may come before the spans of the same steps), so it holds the job's
            # windows for a while. A source that never carries the job costs its first
            # windows at most ``source_idle_s`` of delay, and only when the job is read from
            # a backlog: live, its first window closes later than that anyway.
            for source, seen_s in self._source_seen_s.items():
                if source not in job.progress_ns and now - seen_s < self.source_idle_s:
                    return FAR_PAST
        active = [
            self._agreed_ns(job, source, now)
            for source in job.progress_ns
            if now - self._source_seen_s.get(source, now) < self.source_idle_s
        ]
        slowest = (
            min(active) if active
            else max(self._agreed_ns(job, source, now) for source in job.progress_ns)
        )
        return slowest - self.lateness_ns
