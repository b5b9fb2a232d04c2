"""Tumbling event-time windows per job, keyed by (rank, layer, function, call path).

Span events arrive as columnar batches; each batch is reduced to partial summaries in one
vectorised pass (:mod:`trainscope.schemas.grouping`), and a window's partials are merged once,
when the window closes. Producers that summarise on their own (the PyTorch hook, the host agent,
trace replay) send columnar :class:`SummaryBatch` records, which join the same partials without a
loop over rows; row :class:`FunctionSummary` records of older producers are packed into batches
first.

Time: a window ``[k·W, (k+1)·W)`` closes when the job's watermark passes its end. Each rank is
a source with its own progress (its latest event time); the watermark is the progress of the
slowest *active* rank minus the allowed lateness, so a Kafka partition that is read later than
the others does not turn its events late, and a rank that went silent (a hang) stops holding
windows open once it has been idle for ``idle_s`` of event time. An event for a window that has
already closed is late: it is counted in ``stats.late_events`` and set aside, never silently
merged or lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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

_FN_BITS = 20
_RANK_BITS = 20
_WINDOW_SHIFT = _FN_BITS + _RANK_BITS
_MAX_RANK = (1 << _RANK_BITS) - 1
# Window indices are stored relative to a per-job base so they fit the 23 bits left; an event
# further than that from the job's first window is rejected rather than wrapped into another key.
_WINDOW_MARGIN = 1 << 10
_MAX_REL_WINDOW = (1 << (63 - _WINDOW_SHIFT)) - 1
_SUMMARY_ALL_COLUMNS = {**SUMMARY_COLUMNS, **SUMMARY_SKETCH_COLUMNS}
# Bound on the function dictionaries remembered per job (cleared when full).
_MAX_DICTIONARIES = 4096


@dataclass
class EngineStats:
    spans_received: int = 0
    summaries_received: int = 0
    steps_received: int = 0
    metrics_received: int = 0
    late_events: int = 0
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
    max_event_ns: int = -(2**62)
    progress_ns: np.ndarray = field(default_factory=lambda: np.zeros(0))
    closed_before: int = -(2**62)  # window index: every window below it is closed
    functions: dict[tuple[str, str, int], int] = field(default_factory=dict)
    fn_layer: list[str] = field(default_factory=list)
    fn_name: list[str] = field(default_factory=list)
    fn_callpath: list[int] = field(default_factory=list)
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
        self, window_s: float = 15.0, allowed_lateness_s: float = 5.0, idle_s: float = 60.0
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if allowed_lateness_s < 0:
            raise ValueError(f"allowed_lateness_s must be >= 0, got {allowed_lateness_s}")
        self.window_ns = int(window_s * 1e9)
        self.lateness_ns = int(allowed_lateness_s * 1e9)
        self.idle_ns = int(max(idle_s, 2 * window_s) * 1e9)
        self.stats = EngineStats()
        self._jobs: dict[str, _Job] = {}

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job()
        return job

    def _window(self, job: _Job, index: int) -> _Window:
        window = job.windows.get(index)
        if window is None:
            window = job.windows[index] = _Window()
        return window

    def _observe(self, job: _Job, ranks: np.ndarray, event_ns: np.ndarray) -> None:
        """Advance the progress of each rank to its latest event time."""
        if len(event_ns) == 0:
            return
        job.max_event_ns = max(job.max_event_ns, int(event_ns.max()))
        keep = ranks >= 0  # host-level samples advance no rank
        ranks, event_ns = ranks[keep], event_ns[keep]
        if len(ranks) == 0:
            return
        top = int(ranks.max())
        if top >= len(job.progress_ns):
            grown = np.full(top + 1, np.nan)
            grown[: len(job.progress_ns)] = job.progress_ns
            job.progress_ns = grown
        job.progress_ns[ranks] = np.fmax(job.progress_ns[ranks], event_ns)
        if len(np.unique(ranks)) != len(ranks):  # repeated ranks: fancy assignment keeps one
            np.maximum.at(job.progress_ns, ranks, event_ns)

    def watermark_ns(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        if job is None:
            return -(2**62)
        progress = job.progress_ns[~np.isnan(job.progress_ns)]
        active = progress[progress >= job.max_event_ns - self.idle_ns]
        slowest = float(active.min()) if len(active) else float(job.max_event_ns)
        return int(slowest) - self.lateness_ns

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

    def add_spans(self, batches: list[SpanBatch]) -> None:
        by_job: dict[str, list[SpanBatch]] = {}
        for batch in batches:
            if len(batch):
                by_job.setdefault(batch.job_id, []).append(batch)
        for job_id, job_batches in by_job.items():
            self._add_job_spans(self._job(job_id), job_batches)

    def _add_job_spans(self, job: _Job, batches: list[SpanBatch]) -> None:
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
        self.stats.spans_received += len(fid)

        valid = (rank >= 0) & (rank <= _MAX_RANK) & (duration >= 0)
        if not valid.all():
            self.stats.rejected += int((~valid).sum())
            fid, rank, start, duration, bytes_moved = (
                a[valid] for a in (fid, rank, start, duration, bytes_moved)
            )
        if len(fid) == 0:
            return
        index = start // self.window_ns
        if job.base is None:
            job.base = int(index.min()) - _WINDOW_MARGIN
        on_time = (index >= job.closed_before) & (index >= job.base)
        in_range = index - job.base <= _MAX_REL_WINDOW
        if not (on_time & in_range).all():
            self.stats.late_events += int((~on_time).sum())
            self.stats.rejected += int((on_time & ~in_range).sum())
            on_time &= in_range
            fid, rank, index, duration, bytes_moved, start = (
                a[on_time] for a in (fid, rank, index, duration, bytes_moved, start)
            )
            if len(fid) == 0:
                return
        group = ((index - job.base) << _WINDOW_SHIFT) | (rank << _FN_BITS) | fid
        self._observe_spans(job, rank, start + duration)
        partials = reduce_events(group, duration, bytes_moved)
        window_of_row = partials.group >> _WINDOW_SHIFT
        bounds = np.flatnonzero(np.r_[True, window_of_row[1:] != window_of_row[:-1]])
        for i, lo in enumerate(bounds):
            hi = bounds[i + 1] if i + 1 < len(bounds) else len(window_of_row)
            rel = int(window_of_row[lo])
            part = partials.take(np.arange(lo, hi)) if len(bounds) > 1 else partials
            self._window(job, rel + job.base).partials.append(part)

    def _observe_spans(self, job: _Job, rank: np.ndarray, end_ns: np.ndarray) -> None:
        # Per-rank maxima via one sort of the (usually few) distinct ranks of the batch.
        order = np.argsort(rank, kind="stable")
        sorted_rank = rank[order]
        starts = np.flatnonzero(np.r_[True, sorted_rank[1:] != sorted_rank[:-1]])
        self._observe(job, sorted_rank[starts], np.maximum.reduceat(end_ns[order], starts))

    def add_summaries(self, summaries: Sequence[SummaryBatch | FunctionSummary]) -> None:
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
            self._add_job_summaries(self._job(job_id), job_batches)

    def _add_job_summaries(self, job: _Job, batches: list[SummaryBatch]) -> None:
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
        late = valid & ~on_time
        if late.any():
            self.stats.late_events += int(columns["count"][late].sum())
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
        self._observe_spans(job, rank, end_ns - 1)
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

    def add_steps(self, steps: list[StepRecord]) -> None:
        seen: dict[str, tuple[list[int], list[int]]] = {}
        for step in steps:
            self.stats.steps_received += 1
            job = self._job(step.job_id)
            index = step.start_ns // self.window_ns
            if index < job.closed_before:
                self.stats.late_events += 1
                continue
            self._window(job, index).steps.append(step)
            ranks, ends = seen.setdefault(step.job_id, ([], []))
            ranks.append(step.rank)
            ends.append(step.start_ns + step.duration_ns)
        self._observe_seen(seen)

    def add_metrics(self, samples: list[MetricSample]) -> None:
        seen: dict[str, tuple[list[int], list[int]]] = {}
        for sample in samples:
            self.stats.metrics_received += 1
            job = self._job(sample.job_id)
            index = sample.ts_ns // self.window_ns
            if index < job.closed_before:
                self.stats.late_events += 1
                continue
            self._window(job, index).metrics.append(sample)
            ranks, times = seen.setdefault(sample.job_id, ([], []))
            ranks.append(sample.rank)
            times.append(sample.ts_ns)
        self._observe_seen(seen)

    def _observe_seen(self, seen: dict[str, tuple[list[int], list[int]]]) -> None:
        # Progress of all the records of one call at once: nothing closes in between, and one
        # numpy update per job costs what one per record did (~10 µs).
        for job_id, (ranks, times) in seen.items():
            self._observe(self._jobs[job_id], np.array(ranks), np.array(times))

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
        sort = np.argsort(group, kind="stable")
        group = group[sort]
        order = None if (sort[1:] > sort[:-1]).all() else sort  # None: already in order
        if len(group) > 1 and (group[1:] == group[:-1]).any():
            # Some (rank, function) arrived more than once: merge them (spans come in several
            # batches per window; a producer may send a window twice).
            parts = [merge_partials(Partials.concat(parts) if len(parts) > 1 else parts[0])]
            group, order = parts[0].group, None
        # Otherwise (summary batches, typically) nothing merges and the rows only need sorting:
        # numeric columns are gathered in numpy, the sketches in Arrow, each value copied once.
        fid = group & ((1 << _FN_BITS) - 1)
        rank = (group >> _FN_BITS) & _MAX_RANK
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
    return pd.DataFrame({c: [getattr(s, c) for s in steps] for c in STEP_COLUMNS})


def _metric_frame(samples: list[MetricSample]) -> pd.DataFrame:
    if not samples:
        return WindowView("", 0, 1).metrics
    return pd.DataFrame({c: [getattr(s, c) for s in samples] for c in METRIC_COLUMNS})
