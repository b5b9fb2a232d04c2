"""The window engine: tumbling event-time windows per job, keyed by (rank, layer, function, call
path).

Span events arrive as columnar batches; each batch is reduced to partial summaries in one
vectorised pass (:mod:`trainscope.schemas.grouping`), and a window's partials are merged once,
when the window closes. Producers that summarise on their own (the PyTorch hook, the host agent,
trace replay) send columnar :class:`SummaryBatch` records, which join the same partials without a
loop over rows; row :class:`FunctionSummary` records of older producers are packed into batches
first.

Windows are ``[k·W, (k+1)·W)`` on the epoch grid. A span or step belongs to the window it
started in, a summary to the window of its ``window_start_ns``, a metric sample to the window of
the interval it ends (:func:`metric_window`). The parts, each in a module of its own:

- :mod:`~trainscope.engine.watermarks`: when a window closes (each source's progress, idleness);
- :mod:`~trainscope.engine.clocks`: each rank's clock offset from its peers', corrected before
  windowing, and the records held while it is estimated;
- :mod:`~trainscope.engine.keys`: the group key that packs (window, rank, function) in an int64;
- :mod:`~trainscope.engine.state`: what is kept per job and per open window;
- :mod:`~trainscope.engine.frames`: a closed window's rows as data frames;
- :mod:`~trainscope.engine.snapshot`: the open windows as a checkpoint holds them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from trainscope.engine import snapshot
from trainscope.engine.clocks import (
    MAX_HELD,
    MAX_HELD_ROWS,
    MIN_RANKS,
    Held,
    RankClocks,
    corrected,
    offsets_of,
    rows_of,
)
from trainscope.engine.frames import metric_frame, step_frame, summary_frame
from trainscope.engine.keys import (
    MAX_RANK,
    MAX_REL_WINDOW,
    WINDOW_MARGIN,
    pack,
    window_of,
)
from trainscope.engine.state import FAR_PAST, JobState
from trainscope.engine.watermarks import Watermarks
from trainscope.schemas.grouping import Partials, reduce_events
from trainscope.schemas.records import (
    SUMMARY_COLUMNS,
    SUMMARY_SKETCH_COLUMNS,
    FunctionSummary,
    MetricBatch,
    MetricSample,
    SpanBatch,
    StepBatch,
    StepRecord,
    SummaryBatch,
    Topology,
)
from trainscope.schemas.step_metric import metrics_by_job, steps_by_job
from trainscope.schemas.window import WindowView

log = logging.getLogger(__name__)

_SUMMARY_ALL_COLUMNS = {**SUMMARY_COLUMNS, **SUMMARY_SKETCH_COLUMNS}


def metric_window(ts_ns: int, window_ns: int) -> int:
    """The window index of a metric sample stamped ``ts_ns``.

    A sample is stamped at the *end* of the interval it describes (the host agent stamps its
    window's end; a utilisation reading covers the period before it), while summaries are filed
    by their window's start. So a sample belongs to the window holding the instant just before
    its stamp: one interval's readings and summaries meet in one window of the epoch grid
    (multiples of ``window_ns`` since the Unix epoch), where ``ts_ns // window_ns`` would put the
    readings one window after the summaries of the same interval."""
    return (ts_ns - 1) // window_ns


@dataclass
class EngineStats:
    spans_received: int = 0
    summaries_received: int = 0
    steps_received: int = 0
    metrics_received: int = 0
    late_events: int = 0
    # Step records filed in the window they ended in: their own had closed (see _file_steps).
    steps_outlasting: int = 0
    replayed: int = 0  # records of windows a previous run already wrote
    rejected: int = 0
    windows_closed: int = 0
    summaries_emitted: int = 0
    clock_corrections: int = 0  # a rank's clock offset found beyond the tolerance
    clock_unestimated: int = 0  # held records let go before their ranks' offsets were known


class WindowEngine:
    """Cuts a stream of records into tumbling event-time windows per job and hands each closed
    window on as a :class:`WindowView` (summaries per rank and function, steps, metrics).

    It owns every job's open windows (their input as received), the job's function ids, its
    topology as declared so far, and each source's progress (:class:`Watermarks`); nothing
    else, and no I/O. It is fed from one thread: the stream job that holds it.

    Guarantees:

    - *Windows close on event time.* A window closes once the job's watermark (the slowest
      active source's progress minus ``allowed_lateness_s``) passes its end; :meth:`close_idle`
      closes a job that stopped sending, :meth:`close_all` every window at the end of a stream.
    - *Nothing is dropped silently.* A record for a window that has already closed is late:
      counted in ``stats.late_events`` and set aside, never merged. Records out of range (rank,
      negative duration, too far from the job's first window) are counted in ``stats.rejected``.
      After a restart, windows the previous run wrote are marked with :meth:`restore_closed`;
      records replayed for them are counted in ``stats.replayed`` and skipped, so a window is
      never written from part of its input.
    - *Deterministic.* A window's rows are a function of its input records only, never of their
      arrival order or of how they were grouped into polls: each span batch (one bus message)
      is reduced on its own, partials are merged in a canonical order and rows are sorted by
      their key, so a replayed window gives byte-identical rows and the store's insert
      deduplication removes them.
    - *Restartable.* :meth:`snapshot` and :meth:`restore` carry the open windows over a restart;
      a window finished from a snapshot equals one never interrupted.
    """

    def __init__(
        self,
        window_s: float = 15.0,
        allowed_lateness_s: float = 5.0,
        source_idle_s: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        clock_tolerance_s: float | None = None,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if allowed_lateness_s < 0:
            raise ValueError(f"allowed_lateness_s must be >= 0, got {allowed_lateness_s}")
        if source_idle_s <= 0:
            raise ValueError(f"source_idle_s must be > 0, got {source_idle_s}")
        self.window_ns = int(window_s * 1e9)
        self.lateness_ns = int(allowed_lateness_s * 1e9)
        self.source_idle_s = source_idle_s
        # None: every rank's clock is taken as it is (no estimate, no hold, no correction).
        self.clock_tolerance_ns = (
            None if clock_tolerance_s is None else int(clock_tolerance_s * 1e9)
        )
        self.stats = EngineStats()
        self._clock = clock
        self._jobs: dict[str, JobState] = {}
        self._watermarks = Watermarks(self.lateness_ns, source_idle_s, clock)
        # Inside one_poll(): jobs whose clock estimates are owed at the poll's end.
        self._calibrate_at_poll_end: set[str] | None = None

    def _job(self, job_id: str) -> JobState:
        job = self._jobs.get(job_id)
        if job is None:
            now = self._clock()
            job = self._jobs[job_id] = JobState(first_seen_s=now, last_arrival_s=now)
        return job

    def expect_sources(self, sources: list[Hashable]) -> None:
        """Sources (partitions) just assigned: until one delivers or has been silent for
        ``source_idle_s``, it may carry any job's oldest records, so it holds every window."""
        self._watermarks.expect_sources(sources)

    def watermark_ns(self, job_id: str) -> int:
        return self._watermarks.watermark_ns(self._jobs.get(job_id))

    def closed_before_ns(self) -> dict[str, int]:
        """Per job, the end of the newest closed window: every window before it is closed."""
        return {
            job_id: job.closed_before * self.window_ns
            for job_id, job in self._jobs.items()
            if job.closed_before > FAR_PAST
        }

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def topologies(self) -> dict[str, Topology]:
        """Each job's layout as declared so far (sent once per job: a restart must keep it)."""
        return {j: job.topology for j, job in self._jobs.items() if job.topology is not None}

    def topology(self, job_id: str) -> Topology | None:
        job = self._jobs.get(job_id)
        return job.topology if job is not None else None

    def closed_before(self, job_id: str) -> int:
        """Window index below which every window of the job is closed."""
        job = self._jobs.get(job_id)
        return job.closed_before if job is not None else FAR_PAST

    def snapshot(self) -> dict[str, Any]:
        """Every job's open windows and what windowing them further needs, to be restored by
        :meth:`restore` in a restarted engine (see :mod:`trainscope.engine.snapshot`)."""
        return snapshot.take(self.window_ns, self._jobs)

    def restore(self, state: dict[str, Any]) -> int:
        """Take over a :meth:`snapshot`'s jobs; returns the number of open windows restored.

        Progress per source is not restored: the sources deliver again, and until each has
        or has been silent for ``source_idle_s`` no window closes (:meth:`expect_sources`)."""
        jobs = snapshot.restore(state, self.window_ns, self._clock())
        self._jobs.update(jobs)
        return sum(len(job.windows) for job in jobs.values())

    def restore_closed(self, job_id: str, before_ns: int) -> None:
        """Windows that end at or before ``before_ns`` were written by a previous run."""
        job = self._job(job_id)
        index = before_ns // self.window_ns
        job.closed_before = max(job.closed_before, index)
        job.restored_before = max(job.restored_before, index)

    def _skip_closed(self, job: JobState, index: int, count: int) -> bool:
        """Count records for an already-closed window; True if they must be skipped."""
        if index >= job.closed_before:
            return False
        if index < job.restored_before:
            self.stats.replayed += count
        else:
            self._late(job, index, count)
        return True

    def _late(self, job: JobState, index: int, count: int) -> None:
        self.stats.late_events += count
        if not job.reported_late:  # once per job: the count says how many followed
            job.reported_late = True
            log.warning(
                "late events: %d record(s) for window %d of a job whose windows before %d are "
                "closed (progress per source: %s); counted as late",
                count, index, job.closed_before,
                {str(s): p for s, p in job.progress_ns.items()},
            )

    def add_topology(self, topology: Topology) -> None:
        """Merge by rank: each rank may declare the layout, knowing only its own host."""
        job = self._job(topology.job_id)
        if job.topology is None:
            job.topology = topology
            return
        workers = {w.rank: w for w in job.topology.workers}
        for worker in topology.workers:
            known = workers.get(worker.rank)
            if known is not None and known.host and not worker.host:
                worker = msgspec.structs.replace(
                    worker, host=known.host, local_rank=known.local_rank
                )
            workers[worker.rank] = worker
        job.topology = msgspec.structs.replace(
            topology, workers=[workers[rank] for rank in sorted(workers)]
        )

    def add_spans(self, batches: list[SpanBatch], source: Hashable = 0) -> None:
        """Each batch (one bus message) is reduced on its own, so partials do not depend on
        how messages were grouped into polls."""
        by_job: dict[str, list[SpanBatch]] = {}
        for batch in batches:
            if len(batch):
                by_job.setdefault(batch.job_id, []).append(batch)
        for job_id, job_batches in by_job.items():
            job = self._job(job_id)
            self._file_spans(job, self._admit(job, job_batches, source), source)

    def _file_spans(self, job: JobState, batches: list[SpanBatch], source: Hashable) -> None:
        if batches:
            self._add_job_spans(job, batches, source)

    def _add_job_spans(self, job: JobState, batches: list[SpanBatch], source: Hashable) -> None:
        fids, ranks, starts, durations, moved = [], [], [], [], []
        for batch in batches:
            callpath = batch.column("callpath_id")
            local_fn = batch.column("fn")
            if batch.callpath_id and callpath.any():
                # Distinct (function, call path) pairs get ids; events map to them vectorised.
                pairs, inverse = np.unique(
                    np.stack([local_fn.astype(np.uint64), callpath]), axis=1, return_inverse=True
                )
                layers, names = batch.layers, batch.names
                ids = np.array(
                    [job.functions.fid(layers[int(f)], names[int(f)], int(c)) for f, c in pairs.T],
                    dtype=np.int64,
                )
                fid = ids[inverse.ravel()]
            else:
                plain = zip(batch.layers, batch.names, strict=True)
                table = np.array(
                    [job.functions.fid(layer, name, 0) for layer, name in plain], dtype=np.int64
                )
                fid = table[local_fn]
            fids.append(fid)
            ranks.append(batch.column("rank"))
            starts.append(batch.column("start_ns"))
            durations.append(batch.column("duration_ns"))
            moved.append(batch.column("bytes_moved"))
        fid = np.concatenate(fids)
        rank = np.concatenate(ranks).astype(np.int64)
        start = np.concatenate(starts)
        duration = np.concatenate(durations)
        bytes_moved = np.concatenate(moved)
        unit = np.repeat(np.arange(len(fids)), [len(f) for f in fids])
        self.stats.spans_received += len(fid)

        valid = (rank >= 0) & (rank <= MAX_RANK) & (duration >= 0)
        if not valid.all():
            self.stats.rejected += int((~valid).sum())
            fid, rank, start, duration, bytes_moved, unit = (
                a[valid] for a in (fid, rank, start, duration, bytes_moved, unit)
            )
        if len(fid) == 0:
            return
        index = start // self.window_ns
        if job.base is None:
            job.base = int(index.min()) - WINDOW_MARGIN
        on_time = (index >= job.closed_before) & (index >= job.base)
        in_range = index - job.base <= MAX_REL_WINDOW
        if not (on_time & in_range).all():
            self.stats.rejected += int((on_time & ~in_range).sum())
            replayed = ~on_time & (index < job.restored_before)
            self.stats.replayed += int(replayed.sum())
            late = ~on_time & ~replayed
            if late.any():
                self._late(job, int(index[late].min()), int(late.sum()))
            keep = on_time & in_range
            fid, rank, index, duration, bytes_moved, start, unit = (
                a[keep] for a in (fid, rank, index, duration, bytes_moved, start, unit)
            )
            if len(fid) == 0:
                return
        group = pack(index - job.base, rank, fid)
        self._watermarks.observe(job, source, _newest_per_rank(rank, start + duration))
        partials = reduce_events(group, duration, bytes_moved, unit)
        window_of_row = window_of(partials.group)
        bounds = np.flatnonzero(np.r_[True, window_of_row[1:] != window_of_row[:-1]])
        for i, lo in enumerate(bounds):
            hi = bounds[i + 1] if i + 1 < len(bounds) else len(window_of_row)
            rel = int(window_of_row[lo])
            part = partials.take(np.arange(lo, hi)) if len(bounds) > 1 else partials
            job.window(rel + job.base).partials.append(part)

    def add_summaries(
        self, summaries: Sequence[SummaryBatch | FunctionSummary], source: Hashable = 0
    ) -> None:
        """Merge producers' summaries: columnar batches, or row records (older producers),
        which are packed into one batch per job and window first so both take one path."""
        batches: list[SummaryBatch] = []
        rows: dict[tuple[str, int, int], list[FunctionSummary]] = {}
        for item in summaries:
            if isinstance(item, SummaryBatch):
                if len(item):
                    batches.append(item)
            else:
                key = (item.job_id, item.window_start_ns, item.window_end_ns)
                rows.setdefault(key, []).append(item)
        batches += [SummaryBatch.from_summaries(group) for group in rows.values()]
        by_job: dict[str, list[SummaryBatch]] = {}
        for batch in batches:
            by_job.setdefault(batch.job_id, []).append(batch)
        for job_id, job_batches in by_job.items():
            job = self._job(job_id)
            self._file_summaries(job, self._admit(job, job_batches, source), source)

    def _file_summaries(
        self, job: JobState, batches: list[SummaryBatch], source: Hashable
    ) -> None:
        if batches:
            self._add_job_summaries(job, batches, source)

    def _add_job_summaries(
        self, job: JobState, batches: list[SummaryBatch], source: Hashable
    ) -> None:
        sizes = np.array([len(b) for b in batches], dtype=np.int64)
        self.stats.summaries_received += int(sizes.sum())
        index = np.repeat(
            np.array([b.window_start_ns // self.window_ns for b in batches], dtype=np.int64),
            sizes,
        )
        end_ns = np.repeat(np.array([b.window_end_ns for b in batches], dtype=np.int64), sizes)
        # Columns of all batches joined as bytes, then viewed once: per-batch numpy views
        # would cost more than the rows they hold.
        column = {
            name: np.frombuffer(b"".join([getattr(b, name) for b in batches]), dtype=dtype)
            for name, dtype in _SUMMARY_ALL_COLUMNS.items()
        }
        # Each batch's function indices into the concatenation of the batches' id tables.
        tables = [job.functions.of_batch(b) for b in batches]
        table_base = np.cumsum([0] + [len(t) for t in tables[:-1]])
        fid = np.concatenate(tables)[column["fn"] + np.repeat(table_base, sizes)]
        rank = column["rank"].astype(np.int64)
        columns = {
            name: column[name]
            for name in ("count", "total_ns", "m2_ns2", "min_ns", "max_ns", "bytes_total")
        }
        # Entries per row from the offsets, minus the steps between one batch and the next.
        steps = np.diff(column["sketch_offsets"])
        entries = np.delete(steps, np.cumsum(sizes + 1)[:-1] - 1)
        sketch_key = column["sketch_keys"]
        sketch_count = column["sketch_counts"]
        sketch_row = np.repeat(np.arange(len(rank), dtype=np.int32), entries)

        valid = (rank >= 0) & (rank <= MAX_RANK)
        if not valid.all():
            self.stats.rejected += int((~valid).sum())
        if job.base is None:
            job.base = int(index.min()) - WINDOW_MARGIN
        too_far = valid & (index - job.base > MAX_REL_WINDOW)
        if too_far.any():
            self.stats.rejected += int(too_far.sum())
            valid &= ~too_far
        on_time = (index >= job.closed_before) & (index >= job.base)
        replayed = valid & ~on_time & (index < job.restored_before)
        if replayed.any():
            self.stats.replayed += int(columns["count"][replayed].sum())
        late = valid & ~on_time & ~replayed
        if late.any():
            self._late(job, int(index[late].min()), int(columns["count"][late].sum()))
        keep = valid & on_time
        if not keep.any():
            return
        if not keep.all():
            rows = np.flatnonzero(keep)
            remap = np.full(len(keep), -1, dtype=np.int64)
            remap[rows] = np.arange(len(rows))
            kept_entries = keep[sketch_row]
            sketch_row = remap[sketch_row[kept_entries]]
            sketch_key, sketch_count = sketch_key[kept_entries], sketch_count[kept_entries]
            fid, rank, index, end_ns = fid[rows], rank[rows], index[rows], end_ns[rows]
            columns = {name: values[rows] for name, values in columns.items()}
        group = pack(index - job.base, rank, fid)
        self._watermarks.observe(job, source, _newest_per_rank(rank, end_ns - 1))
        partials = Partials(
            group=group, sketch_row=sketch_row, sketch_key=sketch_key,
            sketch_count=sketch_count, **columns,
        )
        if len(batches) == 1 or (index == index[0]).all():
            job.window(int(index[0])).partials.append(partials)
            return
        # Rows of several windows: hand each window its own rows.
        order = np.argsort(index, kind="stable")
        bounds = np.flatnonzero(np.r_[True, index[order][1:] != index[order][:-1]])
        for rows in np.split(order, bounds[1:]):
            job.window(int(index[rows[0]])).partials.append(partials.take(rows))

    def add_steps(self, steps: Sequence[StepRecord | StepBatch], source: Hashable = 0) -> None:
        """Step records also tell each rank's clock offset (:mod:`~trainscope.engine.clocks`):
        they are noted before any is filed, so that this call's records are already
        corrected when their ranks' offsets become known. Rows are packed into one batch per
        job first: the engine windows steps column by column."""
        for job_id, batch in steps_by_job(steps).items():
            self.stats.steps_received += len(batch)
            job = self._job(job_id)
            if self.clock_tolerance_ns is not None:
                job.clocks.note_steps(batch)
                deferred = self._calibrate_at_poll_end
                if deferred is not None and job.clocks.lookup(batch.column("rank"))[0].all():
                    # Every rank known: a move of its clock is taken at the poll's end, once
                    # for all the poll's sources (a rank not known yet is estimated now, so
                    # that its records need not wait in the hold).
                    deferred.add(job_id)
                else:
                    self._calibrate(job_id, job)
            self._file_steps(job, self._admit(job, [batch], source), source)

    @contextlib.contextmanager
    def one_poll(self) -> Iterator[None]:
        """Records added inside are one poll's: the clock estimates of ranks already known are
        taken again once, at its end, rather than for each source's step records (each taking
        costs the medians of the steps kept, a quarter of a millisecond at 10,000 ranks)."""
        if self._calibrate_at_poll_end is not None:  # nested: the outer poll's end
            yield
            return
        self._calibrate_at_poll_end = deferred = set()
        try:
            yield
        finally:
            self._calibrate_at_poll_end = None
            for job_id in sorted(deferred):
                job = self._jobs.get(job_id)
                if job is None:
                    continue
                try:
                    self._calibrate(job_id, job)
                except Exception:  # as it would have for the records that owed it: logged
                    log.exception("clock estimates of job %s failed", job_id)

    def _file_steps(self, job: JobState, batches: list[Any], source: Hashable) -> None:
        for batch in batches:
            start = batch.column("start_ns")
            end = start + batch.column("duration_ns")
            index = start // self.window_ns
            if int(index.min()) < job.closed_before:
                index = self._outlasting_steps(job, index, end)
            kept = self._file_rows(job, batch, index, "steps")
            if kept is not None:
                self._watermarks.observe(job, source, _newest_per_rank(
                    batch.column("rank")[kept], end[kept]))

    def _outlasting_steps(self, job: JobState, index: np.ndarray, end_ns: np.ndarray
                          ) -> np.ndarray:
        """``index`` with the steps that outlasted the close of the window they started in
        moved to the window they ended in: a validation pass or a checkpoint save inside one
        step takes longer than a window and its lateness, so the step's record comes after its
        window was written, and was dropped as late (the longest step of the run missing from
        the store). A step that ended in a window closed too came late, and stays late; one
        whose window a previous run wrote is counted as replayed, as before."""
        end_index = (end_ns - 1) // self.window_ns
        moved = ((index < job.closed_before) & (index >= job.restored_before)
                 & (end_index >= job.closed_before))
        if moved.any():
            self.stats.steps_outlasting += int(moved.sum())
            index = np.where(moved, end_index, index)
        return index

    def add_metrics(
        self, samples: Sequence[MetricSample | MetricBatch], source: Hashable = 0
    ) -> None:
        """File each sample in the window of the interval it ends (:func:`metric_window`)."""
        for job_id, batch in metrics_by_job(samples).items():
            self.stats.metrics_received += len(batch)
            job = self._job(job_id)
            self._file_metrics(job, self._admit(job, [batch], source), source)

    def _file_metrics(self, job: JobState, batches: list[Any], source: Hashable) -> None:
        for batch in batches:
            ts_ns = batch.column("ts_ns")
            kept = self._file_rows(job, batch, metric_window(ts_ns, self.window_ns), "metrics")
            if kept is not None:
                self._watermarks.observe(
                    job, source, _newest_per_rank(batch.column("rank")[kept], ts_ns[kept]))

    def _file_rows(self, job: JobState, batch: Any, index: np.ndarray, kind: str
                   ) -> np.ndarray | None:
        """Hand each open window its rows of ``batch`` (steps or metrics, by ``index``); rows
        of closed windows are counted (replayed or late). Returns the rows filed (a mask), or
        None if none was."""
        if not len(batch):
            return None
        lo, hi = int(index.min()), int(index.max())
        if lo == hi:  # the usual case: the whole batch in one window
            if self._skip_closed(job, lo, len(batch)):
                return None
            getattr(job.window(lo), kind).append(batch)
            return np.ones(len(batch), dtype=bool)
        kept = np.ones(len(batch), dtype=bool)
        for window in np.unique(index).tolist():
            rows = index == window
            if self._skip_closed(job, window, int(rows.sum())):
                kept &= ~rows
            else:
                getattr(job.window(window), kind).append(batch.take(rows))
        return kept if kept.any() else None

    # -- clocks -----------------------------------------------------------------------------

    def _admit(self, job: JobState, records: list[Any], source: Hashable) -> list[Any]:
        """Of ``records``, those to window now, moved to the job's clock; the others (a rank
        whose offset is not known yet) are held (see :mod:`~trainscope.engine.clocks`)."""
        clocks = job.clocks
        if self.clock_tolerance_ns is None or not clocks.stepping:
            return records
        if job.topology is not None and len(job.topology.workers) < MIN_RANKS:
            return records  # too few peers to tell whose clock is off
        ready = []
        if records:
            # Held records are arrivals too: a job whose every record is held while its
            # clocks are estimated is not idle (idle closing would release them and close its
            # first window before the rest of that window's records came).
            job.last_arrival_s = self._clock()
        unknown, shifted = _rank_flags(clocks, records)
        for i, record in enumerate(records):
            if not unknown[i]:
                ready.append(corrected(record, clocks.offsets_ns, self.window_ns)
                             if shifted[i] else record)
                continue
            if isinstance(record, StepBatch | MetricBatch):
                record, waiting = _split_ready(record, clocks)
                if record is not None:
                    ready.append(corrected(record, clocks.offsets_ns, self.window_ns))
                if waiting is None:
                    continue
                record = waiting
            if clocks.held_since_s is None:
                clocks.held_since_s = self._clock()
            clocks.held.append((source, record))
            clocks.held_rows += rows_of(record)
        if len(clocks.held) > MAX_HELD or clocks.held_rows > MAX_HELD_ROWS:
            self._release(job, force=True)
        return ready

    def _calibrate(self, job_id: str, job: JobState) -> None:
        """Take the job's new clock estimates; release what they make ready."""
        assert self.clock_tolerance_ns is not None
        world = len(job.clocks.ranks)
        if job.topology is not None:
            world = max(world, len(job.topology.workers))
        changed = job.clocks.calibrate(world, self.clock_tolerance_ns)
        for rank in changed:
            offset = job.clocks.offsets_ns[rank]
            if offset:
                self.stats.clock_corrections += 1
                log.warning(
                    "job %s: rank %d's clock is %+.3f s off its peers' (from %d steps); its "
                    "event times are corrected by it", job_id, rank, offset / 1e9,
                    job.clocks.steps_used.get(rank, 0),
                )
        if changed and job.clocks.held:
            self._release(job)

    def _release(self, job: JobState, force: bool = False) -> None:
        """Window the held records whose ranks' offsets are known (all of them with
        ``force``: the ranks still unknown are taken as they are)."""
        clocks = job.clocks
        if force:
            self.stats.clock_unestimated += sum(not clocks.ready(r) for _, r in clocks.held)
            clocks.trust_the_rest(clocks.held)
        held, clocks.held = clocks.held, []
        by_source: dict[Hashable, list[Held]] = {}
        for source, record in held:
            if clocks.ready(record):
                by_source.setdefault(source, []).append(record)
            else:
                clocks.held.append((source, record))
        clocks.held_since_s = clocks.held_since_s if clocks.held else None
        clocks.held_rows = sum(rows_of(r) for _, r in clocks.held)
        for source, records in by_source.items():
            fixed = [corrected(r, clocks.offsets_ns, self.window_ns) for r in records]
            steps = [r for r in fixed if isinstance(r, StepBatch | StepRecord)]
            metrics = [r for r in fixed if isinstance(r, MetricBatch | MetricSample)]
            self._file_steps(job, list(steps_by_job(steps).values()), source)
            self._file_metrics(job, list(metrics_by_job(metrics).values()), source)
            self._file_spans(job, [r for r in fixed if isinstance(r, SpanBatch)], source)
            self._file_summaries(job, [r for r in fixed if isinstance(r, SummaryBatch)], source)

    def _release_overdue(self, job: JobState, everything: bool = False) -> None:
        """Held records wait at most ``source_idle_s`` (all of them at the end of a job)."""
        since = job.clocks.held_since_s
        if since is not None and (everything or self._clock() - since >= self.source_idle_s):
            self._release(job, force=True)

    # -- output -----------------------------------------------------------------------------

    def close_ready(self) -> list[WindowView]:
        """Close every window whose end the watermark has passed, oldest first."""
        closed = []
        for job_id, job in self._jobs.items():
            self._release_overdue(job)
            watermark = self.watermark_ns(job_id)
            for index in sorted(job.windows):
                if (index + 1) * self.window_ns > watermark:
                    break
                closed.append(self._close(job_id, job, index))
        return closed

    def close_all(self) -> list[WindowView]:
        """Close every open window (end of stream)."""
        closed = []
        for job_id, job in self._jobs.items():
            self._release_overdue(job, everything=True)
            for index in sorted(job.windows):
                closed.append(self._close(job_id, job, index))
        return closed

    def evict_job(self, job_id: str) -> list[WindowView]:
        """Close a job's open windows and forget the job (a bound on how many jobs are kept);
        a later record of the job starts it afresh."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return []
        self._release_overdue(job, everything=True)
        return [self._close(job_id, job, index) for index in sorted(job.windows)]

    def close_idle(self, job_idle_s: float) -> list[WindowView]:
        """Close every window of the jobs that sent nothing for ``job_idle_s`` of processing
        time: a finished job's last windows would otherwise wait for events that never come."""
        now = self._clock()
        closed = []
        for job_id, job in self._jobs.items():
            if (job.windows or job.clocks.held) and now - job.last_arrival_s >= job_idle_s:
                self._release_overdue(job, everything=True)
                for index in sorted(job.windows):
                    closed.append(self._close(job_id, job, index))
        return closed

    def on_job_clock(self, record: Held) -> Held:
        """``record`` with the known clock offsets of its ranks taken off (as it is when they
        are not known yet): which windows it will feed."""
        job = self._jobs.get(record.job_id)
        if job is None or not job.clocks.offsets_ns:
            return record
        return corrected(record, job.clocks.offsets_ns, self.window_ns)

    def offset_ns(self, job_id: str, rank: int) -> int:
        """The known clock offset of the job's rank (0 when not known)."""
        job = self._jobs.get(job_id)
        return 0 if job is None else job.clocks.offsets_ns.get(rank, 0)

    def offsets_of(self, job_id: str, rank: np.ndarray) -> np.ndarray | None:
        """Each of ``rank``'s known clock offset in the job, or None when none is known."""
        job = self._jobs.get(job_id)
        if job is None or not job.clocks.offsets_ns:
            return None
        return offsets_of(rank, job.clocks.offsets_ns)

    def held_records(self) -> int:
        """Records held while their ranks' clock offsets are estimated (each step record and
        metric sample of a batch counts as one, as it would sent as a row)."""
        return sum(len(record) if isinstance(record, StepBatch | MetricBatch) else 1
                   for job in self._jobs.values() for _, record in job.clocks.held)

    def open_windows(self) -> int:
        return sum(len(job.windows) for job in self._jobs.values())

    def _close(self, job_id: str, job: JobState, index: int) -> WindowView:
        window = job.windows.pop(index)
        job.closed_before = max(job.closed_before, index + 1)
        self.stats.windows_closed += 1
        view = WindowView(
            job_id=job_id,
            window_start_ns=index * self.window_ns,
            window_end_ns=(index + 1) * self.window_ns,
            summaries=summary_frame(job.functions, window.partials),
            steps=step_frame(window.steps),
            metrics=metric_frame(window.metrics),
            topology=job.topology,
            clock_offsets=job.clocks.reported(),
        )
        self.stats.summaries_emitted += len(view.summaries)
        return view


def _rank_flags(clocks: RankClocks, records: list[Any]) -> tuple[list[bool], list[bool]]:
    """Per record: whether any of its ranks' offsets is still unknown, and whether any of its
    rows moves (a known, non-zero offset); looked up for all records' rows at once (a
    10,000-rank job brings ten thousand single-rank batches a window)."""
    columns = [np.array([r.rank]) if isinstance(r, StepRecord | MetricSample)
               else r.column("rank") for r in records]
    lengths = np.fromiter((len(c) for c in columns), dtype=np.int64, count=len(columns))
    unknown = np.zeros(len(records), dtype=bool)
    shifted = np.zeros(len(records), dtype=bool)
    filled = lengths > 0
    if filled.any():
        known, offsets = clocks.lookup(np.concatenate(columns))
        starts = (np.cumsum(lengths) - lengths)[filled]
        unknown[filled] = np.logical_or.reduceat(~known, starts)
        shifted[filled] = np.logical_or.reduceat(offsets != 0, starts)
    return unknown.tolist(), shifted.tolist()


def _split_ready(batch: Any, clocks: RankClocks) -> tuple[Any, Any]:
    """(rows whose ranks' clock offsets are known, rows still waiting); None for no rows."""
    ready, _ = clocks.lookup(batch.column("rank"))
    if ready.all():
        return batch, None
    if not ready.any():
        return None, batch
    return batch.take(ready), batch.take(~ready)


def _newest_per_rank(rank: np.ndarray, event_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ranks, and each one's latest event time among ``event_ns``."""
    distinct, inverse = np.unique(rank, return_inverse=True)
    newest = np.full(len(distinct), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(newest, inverse.ravel(), event_ns.astype(np.int64))
    return distinct, newest
