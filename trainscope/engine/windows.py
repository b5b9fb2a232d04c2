"""Tumbling event-time windows per job, keyed by (rank, layer, function, call path).

Span events arrive as columnar batches; each batch is reduced to partial summaries in one
vectorised pass (:mod:`trainscope.schemas.grouping`), and a window's partials are merged once,
when the window closes. Producers that summarise on their own (the PyTorch hook, the host agent,
trace replay) send columnar :class:`SummaryBatch` records, which join the same partials without a
loop over rows; row :class:`FunctionSummary` records of older producers are packed into batches
first.

Time: a window ``[k·W, (k+1)·W)`` closes when the job's watermark passes its end. Every
*source* that carries a job (a Kafka partition, or the one source of records handed over
directly) has its own progress for that job: the latest event time it delivered. The watermark
is the progress of the slowest *active* source minus the allowed lateness, so a partition that is
read later than the others delays the job's windows instead of turning its events late. A source
is idle once it has delivered nothing for ``source_idle_s`` of processing time (caught up, or all
its producers silent); idle sources stop holding windows open, so a hung rank (whose partition
also carries live ranks, or goes quiet) never stops the job. A job that stops sending altogether
has its windows closed after ``job_idle_s`` of processing time (:meth:`close_idle`). For its
first ``source_idle_s``, a job's windows are also held by every busy source that has not
delivered its records yet: which sources carry a job is learnt, not declared, and one whose
reader lags (a partition fetched late, a worker that forwards it started late) would otherwise
not count until its first record of the job came, late.

An event for a window that has already closed is late: it is counted in ``stats.late_events``
and set aside, never silently merged or lost. After a restart, windows the previous run already
wrote are marked with :meth:`restore_closed`; records replayed for them are counted in
``stats.replayed`` and skipped, so a window is never written from part of its input.

Determinism: a window's rows are a function of its input records only, never of their arrival
order or of how they were grouped into polls. Each span batch (one bus message) is reduced on its
own, partials are merged in a canonical order, and rows are sorted by their key, so a replayed
window gives byte-identical rows and the store's insert deduplication removes them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa

from trainscope.schemas.grouping import Partials, merge_partials, reduce_events
from trainscope.schemas.records import (
    SUMMARY_COLUMNS,
    SUMMARY_SKETCH_COLUMNS,
    FunctionSummary,
    MetricSample,
    SpanBatch,
    StepRecord,
    SummaryBatch,
    Topology,
)
from trainscope.schemas.window import METRIC_COLUMNS, STEP_COLUMNS, WindowView

log = logging.getLogger(__name__)

_FN_BITS = 20
_RANK_BITS = 20
_WINDOW_SHIFT = _FN_BITS + _RANK_BITS
_MAX_RANK = (1 << _RANK_BITS) - 1
# Window indices are stored relative to a per-job base so they fit the 23 bits left; an event
# further than that from the job's first window is rejected rather than wrapped into another key.
_WINDOW_MARGIN = 1 << 10
_MAX_REL_WINDOW = (1 << (63 - _WINDOW_SHIFT)) - 1
_SUMMARY_ALL_COLUMNS = {**SUMMARY_COLUMNS, **SUMMARY_SKETCH_COLUMNS}
_ENCODER = msgspec.msgpack.Encoder()
_STEPS = msgspec.msgpack.Decoder(list[StepRecord])
_METRICS = msgspec.msgpack.Decoder(list[MetricSample])
# Bound on the function dictionaries remembered per job (cleared when full).
_MAX_DICTIONARIES = 4096


@dataclass
class EngineStats:
    spans_received: int = 0
    summaries_received: int = 0
    steps_received: int = 0
    metrics_received: int = 0
    late_events: int = 0
    replayed: int = 0  # records of windows a previous run already wrote
    rejected: int = 0
    windows_closed: int = 0
    summaries_emitted: int = 0


@dataclass
class _Window:
    partials: list[Partials] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    metrics: list[MetricSample] = field(default_factory=list)


@dataclass
class _Job:
    base: int | None = None
    progress_ns: dict[Hashable, int] = field(default_factory=dict)  # per source
    last_arrival_s: float = 0.0  # processing time
    first_seen_s: float = 0.0  # processing time this engine started (or restored) the job
    closed_before: int = -(2**62)  # window index: every window below it is closed
    restored_before: int = -(2**62)  # window index: written by a previous run
    reported_late: bool = False
    functions: dict[tuple[str, str, int], int] = field(default_factory=dict)
    fn_layer: list[str] = field(default_factory=list)
    fn_name: list[str] = field(default_factory=list)
    fn_callpath: list[int] = field(default_factory=list)
    fn_order: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Function ids of the summary batches' function dictionaries seen lately.
    dictionaries: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]], np.ndarray] = (
        field(default_factory=dict)
    )
    windows: dict[int, _Window] = field(default_factory=dict)
    topology: Topology | None = None

    def fid(self, layer: str, name: str, callpath: int) -> int:
        key = (layer, name, callpath)
        fid = self.functions.get(key)
        if fid is None:
            fid = self.functions[key] = len(self.fn_layer)
            if fid >= 1 << _FN_BITS:
                raise ValueError(f"more than {1 << _FN_BITS} distinct functions in one job")
            self.fn_layer.append(layer)
            self.fn_name.append(name)
            self.fn_callpath.append(callpath)
        return fid


class WindowEngine:
    def __init__(
        self,
        window_s: float = 15.0,
        allowed_lateness_s: float = 5.0,
        source_idle_s: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
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
        self.stats = EngineStats()
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._source_seen_s: dict[Hashable, float] = {}
        self._expected_s: dict[Hashable, float] = {}  # sources assigned, not heard from yet

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job(first_seen_s=self._clock())
        return job

    def _window(self, job: _Job, index: int) -> _Window:
        window = job.windows.get(index)
        if window is None:
            window = job.windows[index] = _Window()
        return window

    def _observe(self, job: _Job, source: Hashable, event_ns: int) -> None:
        """Advance the job's progress on ``source`` to ``event_ns`` (the latest event time)."""
        now = self._clock()
        self._source_seen_s[source] = now
        job.last_arrival_s = now
        known = job.progress_ns.get(source)
        if known is None or event_ns > known:
            job.progress_ns[source] = event_ns

    def expect_sources(self, sources: list[Hashable]) -> None:
        """Sources (partitions) just assigned: until one delivers or has been silent for
        ``source_idle_s``, it may carry any job's oldest records, so it holds every window."""
        now = self._clock()
        for source in sources:
            if source not in self._source_seen_s:
                self._expected_s.setdefault(source, now)

    def watermark_ns(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        if job is None or not job.progress_ns:
            return -(2**62)
        now = self._clock()
        if self._expected_s:
            for source in [s for s in self._expected_s if s in self._source_seen_s]:
                del self._expected_s[source]
            if any(now - since < self.source_idle_s for since in self._expected_s.values()):
                return -(2**62)
        if now - job.first_seen_s < self.source_idle_s:
            # A new job: a source that is busy but has not delivered this job's records yet
            # may still carry its oldest ones (its reader lags, or they come another way, as
            # metrics may come before the spans of the same steps), so it holds the job's
            # windows for a while. A source that never carries the job costs its first
            # windows at most ``source_idle_s`` of delay, and only when the job is read from
            # a backlog: live, its first window closes later than that anyway.
            for source, seen_s in self._source_seen_s.items():
                if source not in job.progress_ns and now - seen_s < self.source_idle_s:
                    return -(2**62)
        active = [
            progress
            for source, progress in job.progress_ns.items()
            if now - self._source_seen_s.get(source, now) < self.source_idle_s
        ]
        slowest = min(active) if active else max(job.progress_ns.values())
        return slowest - self.lateness_ns

    def closed_before_ns(self) -> dict[str, int]:
        """Per job, the end of the newest closed window: every window before it is closed."""
        return {
            job_id: job.closed_before * self.window_ns
            for job_id, job in self._jobs.items()
            if job.closed_before > -(2**62)
        }

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    def topologies(self) -> dict[str, Topology]:
        """Each job's layout as declared so far (sent once per job: a restart must keep it)."""
        return {j: job.topology for j, job in self._jobs.items() if job.topology is not None}

    def closed_before(self, job_id: str) -> int:
        """Window index below which every window of the job is closed."""
        job = self._jobs.get(job_id)
        return job.closed_before if job is not None else -(2**62)

    def snapshot(self) -> dict[str, Any]:
        """Every job's open windows and what windowing them further needs, to be restored by
        :meth:`restore` in a restarted engine (see :mod:`trainscope.engine.checkpoint`).

        Partials are kept as they arrived, not merged: a window finished from a snapshot is
        then the same function of the same inputs as one never interrupted, row for row."""
        jobs = {
            job_id: dataclasses.replace(
                job, progress_ns={}, last_arrival_s=0.0, reported_late=False, dictionaries={},
                windows={},
            )
            for job_id, job in self._jobs.items()
        }
        # Steps and metrics as msgpack: pickling them struct by struct costs ~25 µs each.
        windows = {
            job_id: {
                index: (window.partials, _ENCODER.encode(window.steps),
                        _ENCODER.encode(window.metrics))
                for index, window in job.windows.items()
            }
            for job_id, job in self._jobs.items()
        }
        return {"window_ns": self.window_ns, "jobs": jobs, "windows": windows}

    def restore(self, snapshot: dict[str, Any]) -> int:
        """Take over a :meth:`snapshot`'s jobs; returns the number of open windows restored.

        Progress per source is not restored: the sources deliver again, and until each has
        or has been silent for ``source_idle_s`` no window closes (:meth:`expect_sources`)."""
        if snapshot.get("window_ns") != self.window_ns:
            raise ValueError(
                f"the checkpoint's windows are {snapshot.get('window_ns', 0) / 1e9:g} s long, "
                f"this engine's {self.window_ns / 1e9:g} s: restart with the same --window-s"
            )
        now = self._clock()
        restored = 0
        for job_id, job in snapshot["jobs"].items():
            job.windows = {
                index: _Window(partials, _STEPS.decode(steps), _METRICS.decode(metrics))
                for index, (partials, steps, metrics) in snapshot["windows"][job_id].items()
            }
            job.last_arrival_s = now
            job.first_seen_s = now
            job.restored_before = max(job.restored_before, job.closed_before)
            self._jobs[job_id] = job
            restored += len(job.windows)
        return restored

    def restore_closed(self, job_id: str, before_ns: int) -> None:
        """Windows that end at or before ``before_ns`` were written by a previous run."""
        job = self._job(job_id)
        index = before_ns // self.window_ns
        job.closed_before = max(job.closed_before, index)
        job.restored_before = max(job.restored_before, index)

    def _skip_closed(self, job: _Job, index: int, count: int) -> bool:
        """Count records for an already-closed window; True if they must be skipped."""
        if index >= job.closed_before:
            return False
        if index < job.restored_before:
            self.stats.replayed += count
        else:
            self._late(job, index, count)
        return True

    def _late(self, job: _Job, index: int, count: int) -> None:
        self.stats.late_events += count
        if not job.reported_late:  # once per job: the count says how many followed
            job.reported_late = True
            log.warning(
                "late events: %d record(s) for window %d of a job whose windows before %d are "
                "closed (progress per source: %s); counted as late",
                count, index, job.closed_before,
                {str(s): p for s, p in job.progress_ns.items()},
            )

    # -- input ------------------------------------------------------------------------------

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
            self._add_job_spans(self._job(job_id), job_batches, source)

    def _add_job_spans(self, job: _Job, batches: list[SpanBatch], source: Hashable) -> None:
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
                    [job.fid(layers[int(f)], names[int(f)], int(c)) for f, c in pairs.T],
                    dtype=np.int64,
                )
                fid = ids[inverse.ravel()]
            else:
                table = np.array(
                    [job.fid(layer, name, 0) for layer, name in zip(batch.layers, batch.names,
                                                                    strict=True)],
                    dtype=np.int64,
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

        valid = (rank >= 0) & (rank <= _MAX_RANK) & (duration >= 0)
        if not valid.all():
            self.stats.rejected += int((~valid).sum())
            fid, rank, start, duration, bytes_moved, unit = (
                a[valid] for a in (fid, rank, start, duration, bytes_moved, unit)
            )
        if len(fid) == 0:
            return
        index = start // self.window_ns
        if job.base is None:
            job.base = int(index.min()) - _WINDOW_MARGIN
        on_time = (index >= job.closed_before) & (index >= job.base)
        in_range = index - job.base <= _MAX_REL_WINDOW
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
        group = ((index - job.base) << _WINDOW_SHIFT) | (rank << _FN_BITS) | fid
        self._observe(job, source, int((start + duration).max()))
        partials = reduce_events(group, duration, bytes_moved, unit)
        window_of_row = partials.group >> _WINDOW_SHIFT
        bounds = np.flatnonzero(np.r_[True, window_of_row[1:] != window_of_row[:-1]])
        for i, lo in enumerate(bounds):
            hi = bounds[i + 1] if i + 1 < len(bounds) else len(window_of_row)
            rel = int(window_of_row[lo])
            part = partials.take(np.arange(lo, hi)) if len(bounds) > 1 else partials
            self._window(job, rel + job.base).partials.append(part)

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
            self._add_job_summaries(self._job(job_id), job_batches, source)

    def _add_job_summaries(
        self, job: _Job, batches: list[SummaryBatch], source: Hashable
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
        tables = [self._fids(job, b) for b in batches]
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

        valid = (rank >= 0) & (rank <= _MAX_RANK)
        if not valid.all():
            self.stats.rejected += int((~valid).sum())
        if job.base is None:
            job.base = int(index.min()) - _WINDOW_MARGIN
        too_far = valid & (index - job.base > _MAX_REL_WINDOW)
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
        group = ((index - job.base) << _WINDOW_SHIFT) | (rank << _FN_BITS) | fid
        self._observe(job, source, int(end_ns.max()) - 1)
        partials = Partials(
            group=group, sketch_row=sketch_row, sketch_key=sketch_key,
            sketch_count=sketch_count, **columns,
        )
        if len(batches) == 1 or (index == index[0]).all():
            self._window(job, int(index[0])).partials.append(partials)
            return
        # Rows of several windows: hand each window its own rows.
        order = np.argsort(index, kind="stable")
        bounds = np.flatnonzero(np.r_[True, index[order][1:] != index[order][:-1]])
        for rows in np.split(order, bounds[1:]):
            self._window(job, int(index[rows[0]])).partials.append(partials.take(rows))

    @staticmethod
    def _fids(job: _Job, batch: SummaryBatch) -> np.ndarray:
        """Job-wide function id of each of the batch's functions."""
        # Each rank sends the same function dictionary window after window (and ranks of one
        # job mostly the same one): one lookup per dictionary instead of one per function.
        key = (tuple(batch.layers), tuple(batch.names), tuple(batch.callpaths))
        fids = job.dictionaries.get(key)
        if fids is None:
            if len(job.dictionaries) >= _MAX_DICTIONARIES:
                job.dictionaries.clear()
            fids = job.dictionaries[key] = np.array(
                [job.fid(layer, name, path) for layer, name, path in zip(*key, strict=True)],
                dtype=np.int64,
            )
        return fids

    def add_steps(self, steps: list[StepRecord], source: Hashable = 0) -> None:
        for step in steps:
            self.stats.steps_received += 1
            job = self._job(step.job_id)
            index = step.start_ns // self.window_ns
            if self._skip_closed(job, index, 1):
                continue
            self._window(job, index).steps.append(step)
            self._observe(job, source, step.start_ns + step.duration_ns)

    def add_metrics(self, samples: list[MetricSample], source: Hashable = 0) -> None:
        """File each sample in the window of the interval it ends (:func:`metric_window`)."""
        for sample in samples:
            self.stats.metrics_received += 1
            job = self._job(sample.job_id)
            index = metric_window(sample.ts_ns, self.window_ns)
            if self._skip_closed(job, index, 1):
                continue
            self._window(job, index).metrics.append(sample)
            self._observe(job, source, sample.ts_ns)

    # -- output -----------------------------------------------------------------------------

    def close_ready(self) -> list[WindowView]:
        """Close every window whose end the watermark has passed, oldest first."""
        closed = []
        for job_id, job in self._jobs.items():
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
            for index in sorted(job.windows):
                closed.append(self._close(job_id, job, index))
        return closed

    def evict_job(self, job_id: str) -> list[WindowView]:
        """Close a job's open windows and forget the job (a bound on how many jobs are kept);
        a later record of the job starts it afresh."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return []
        return [self._close(job_id, job, index) for index in sorted(job.windows)]

    def close_idle(self, job_idle_s: float) -> list[WindowView]:
        """Close every window of the jobs that sent nothing for ``job_idle_s`` of processing
        time: a finished job's last windows would otherwise wait for events that never come."""
        now = self._clock()
        closed = []
        for job_id, job in self._jobs.items():
            if job.windows and now - job.last_arrival_s >= job_idle_s:
                for index in sorted(job.windows):
                    closed.append(self._close(job_id, job, index))
        return closed

    def open_windows(self) -> int:
        return sum(len(job.windows) for job in self._jobs.values())

    def _close(self, job_id: str, job: _Job, index: int) -> WindowView:
        window = job.windows.pop(index)
        job.closed_before = max(job.closed_before, index + 1)
        self.stats.windows_closed += 1
        view = WindowView(
            job_id=job_id,
            window_start_ns=index * self.window_ns,
            window_end_ns=(index + 1) * self.window_ns,
            summaries=self._summary_frame(job, window.partials),
            steps=_step_frame(window.steps),
            metrics=_metric_frame(window.metrics),
            topology=job.topology,
        )
        self.stats.summaries_emitted += len(view.summaries)
        return view

    def _summary_frame(self, job: _Job, parts: list[Partials]) -> pd.DataFrame:
        if not parts:
            return WindowView("", 0, 1).summaries
        group = np.concatenate([p.group for p in parts]) if len(parts) > 1 else parts[0].group
        if len(group) > 1 and _has_repeats(group):
            # Some (rank, function) arrived more than once: merge them (spans come in several
            # batches per window; a producer may send a window twice). merge_partials merges in
            # an order fixed by the values, so the result does not depend on arrival order.
            parts = [merge_partials(Partials.concat(parts) if len(parts) > 1 else parts[0])]
            group = parts[0].group
        # Otherwise (summary batches, typically) nothing merges and the rows only need sorting:
        # numeric columns are gathered in numpy, the sketches in Arrow, each value copied once.
        fid = group & ((1 << _FN_BITS) - 1)
        rank = (group >> _FN_BITS) & _MAX_RANK
        # Rows sorted by (rank, layer, name, call path): function ids follow arrival order and
        # must not decide the row order, or a replayed window would not be byte-identical.
        order: np.ndarray | None = np.lexsort((self._function_order(job)[fid], rank))
        if (order[1:] > order[:-1]).all():
            order = None  # already in order
        else:
            fid, rank = fid[order], rank[order]
        columns = {
            name: _gather([getattr(p, name) for p in parts], order).astype(dtype, copy=False)
            for name, dtype in (("count", np.int64), ("total_ns", np.int64),
                                ("m2_ns2", np.float64), ("min_ns", np.int64),
                                ("max_ns", np.int64), ("bytes_total", np.int64))
        }
        # The sketches stay flat: Arrow list columns over the partials' arrays, built without a
        # Python object per row (a row still reads as a list). Lists of Python ints cost about
        # 3 µs per summary at typical sketch sizes, more than the rest of the window together.
        offsets = [np.searchsorted(p.sketch_row, np.arange(len(p.group) + 1)) for p in parts]
        return pd.DataFrame(
            {
                "rank": rank,
                "layer": _string_column(job.fn_layer, fid),
                "name": _string_column(job.fn_name, fid),
                "callpath_id": np.asarray(job.fn_callpath, dtype=np.uint64)[fid],
                **columns,
                "sketch_keys": _list_column(offsets, [p.sketch_key for p in parts], order),
                "sketch_counts": _list_column(offsets, [p.sketch_count for p in parts], order),
            }
        )

    @staticmethod
    def _function_order(job: _Job) -> np.ndarray:
        """Each function id's position in (layer, name, call path) order."""
        n = len(job.fn_layer)
        if len(job.fn_order) != n:  # functions were added since the last window
            keys = sorted(range(n), key=lambda i: (job.fn_layer[i], job.fn_name[i],
                                                   job.fn_callpath[i]))
            job.fn_order = np.empty(n, dtype=np.int64)
            job.fn_order[keys] = np.arange(n)
        return job.fn_order


def metric_window(ts_ns: int, window_ns: int) -> int:
    """The window index of a metric sample stamped ``ts_ns``.

    A sample is stamped at the *end* of the interval it describes (the host agent stamps its
    window's end; a utilisation reading covers the period before it), while summaries are filed
    by their window's start. So a sample belongs to the window holding the instant just before
    its stamp: one interval's readings and summaries meet in one window of the epoch grid
    (multiples of ``window_ns`` since the Unix epoch), where ``ts_ns // window_ns`` would put the
    readings one window after the summaries of the same interval."""
    return (ts_ns - 1) // window_ns


def _has_repeats(keys: np.ndarray) -> bool:
    # A sort and a comparison of neighbours: numpy 2's hash-based unique took 10x longer on
    # a window of 0.5 M keys.
    ordered = np.sort(keys)
    return bool((ordered[1:] == ordered[:-1]).any())


def _gather(chunks: list[np.ndarray], order: np.ndarray | None) -> np.ndarray:
    values = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    return values if order is None else values[order]


def _string_column(values: list[str], index: np.ndarray) -> pd.api.extensions.ExtensionArray:
    # Taken in Arrow: the same column pandas makes of Python strings, without one per row.
    return pd.array(pa.array(values, type=pa.string()).take(pa.array(index)), dtype=_STR)


_STR = pd.Series(["x"]).dtype


def _list_column(
    offsets: list[np.ndarray], values: list[np.ndarray], order: np.ndarray | None
) -> pd.arrays.ArrowExtensionArray:
    """Row ``i`` of chunk ``c`` holds ``values[c][offsets[c][i]:offsets[c][i + 1]]``; the rows
    of all chunks, in ``order`` when given."""
    lists = pa.chunked_array([
        pa.LargeListArray.from_arrays(
            pa.array(o, type=pa.int64()), pa.array(v.astype(np.int64, copy=False))
        )
        for o, v in zip(offsets, values, strict=True)
    ])
    if order is not None:
        lists = lists.take(pa.array(order))
    return pd.arrays.ArrowExtensionArray(lists)


def _step_frame(steps: list[StepRecord]) -> pd.DataFrame:
    if not steps:
        return WindowView("", 0, 1).steps
    frame = pd.DataFrame({c: [getattr(s, c) for s in steps] for c in STEP_COLUMNS})
    return frame.sort_values(list(STEP_COLUMNS), kind="stable", ignore_index=True)


def _metric_frame(samples: list[MetricSample]) -> pd.DataFrame:
    if not samples:
        return WindowView("", 0, 1).metrics
    frame = pd.DataFrame({c: [getattr(s, c) for s in samples] for c in METRIC_COLUMNS})
    return frame.sort_values(
        ["rank", "name", "device", "host", "ts_ns", "value"], kind="stable", ignore_index=True
    )
