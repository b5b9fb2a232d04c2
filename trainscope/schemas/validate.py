"""Semantic checks on decoded records: what msgspec's type checks cannot know.

Decoding proves a record has the right shape; it does not prove the values are usable. A rank of
2**40, a timestamp of 0, a NaN reading or a 1 MB function name all decode, and each one would
make a later stage allocate, overflow or mislead a detector. :class:`Validator` checks every
field against :class:`Limits` before a record reaches the window engine.

Policy: a bus message is accepted or rejected **whole**. One bad record sets aside the entire
message (with a reason naming the record index, field and value), so a message is never half
applied and a dead letter can be replayed as the unit it was sent as.

Ranks are checked against the job's world size once its :class:`Topology` is known (a topology
earlier in the same message counts), and against ``Limits.max_ranks`` before that.

Cost: the span columns of a whole poll are joined and checked in a few numpy passes (never a
Python loop per event), and each row record passes one combined test; only a message that fails
is walked field by field to name the problem. See :meth:`Validator.validate_many`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas.records import (
    SCHEMA_VERSION,
    SUMMARY_COLUMNS,
    SUMMARY_SKETCH_COLUMNS,
    ControlMessage,
    Finding,
    FindingCallPath,
    FunctionSummary,
    MetricSample,
    ProfileCallPaths,
    Record,
    SpanBatch,
    SpanEvent,
    StepRecord,
    SummaryBatch,
    Topology,
)

_INT64_MAX = 2**63 - 1
_UINT64_MAX = 2**64 - 1
# The window engine packs a rank into 20 bits of its grouping key.
RANK_CEILING = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What a record's values may be. Times are Unix nanoseconds, durations nanoseconds."""

    min_time_ns: int = 946_684_800 * 10**9  # 2000-01-01T00:00:00Z
    max_future_ns: int = 86_400 * 10**9  # a producer's clock may run ahead by up to a day
    max_duration_ns: int = 7 * 86_400 * 10**9
    # Largest world size accepted; also the rank bound for a job whose topology is not known.
    max_ranks: int = 1 << 17
    max_id_chars: int = 256  # job ids, hosts, metric names
    max_name_chars: int = 4096  # function names (C++ kernel names run long)
    max_functions: int = 1 << 16  # per span batch
    max_sketch_buckets: int = 4096
    max_devices: int = 1 << 10
    now_ns: Callable[[], int] = field(default=time.time_ns, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.max_ranks <= RANK_CEILING:
            raise ValueError(f"max_ranks must be in (0, {RANK_CEILING}], got {self.max_ranks}")
        for name in ("max_future_ns", "max_duration_ns", "max_id_chars", "max_name_chars",
                     "max_functions", "max_sketch_buckets", "max_devices"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class InvalidRecord(ValueError):
    """One record of a message failed a check; ``str()`` is the one-line dead-letter reason."""

    def __init__(self, index: int, kind: str, detail: str) -> None:
        self.index = index
        self.kind = kind
        self.detail = detail
        super().__init__(f"records[{index}] ({kind}): {detail}")


class _Bad(Exception):
    """Raised by the checks of one record; becomes an :class:`InvalidRecord` with its index."""


class Validator:
    """Checks records against :class:`Limits` and remembers each job's declared world size."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits if limits is not None else Limits()
        self._world_size: dict[str, int] = {}
        self._dictionaries_ok: set[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]] = set()
        self._now_ns = self.limits.now_ns()
        self._max_time_ns = self._now_ns + self.limits.max_future_ns

    def world_size(self, job_id: str) -> int | None:
        return self._world_size.get(job_id)

    def forget(self, job_id: str) -> None:
        self._world_size.pop(job_id, None)

    def world_sizes(self) -> dict[str, int]:
        """The world size each job declared (to carry over a restart)."""
        return dict(self._world_size)

    def remember_world_sizes(self, sizes: dict[str, int]) -> None:
        self._world_size.update(sizes)

    def validate(self, records: Sequence[Record]) -> None:
        """Raise :class:`InvalidRecord` for the first bad record; accept the message otherwise.

        World sizes declared by the message's topologies are remembered only if every record
        passes, so a rejected message leaves no trace.
        """
        error = self.validate_many([records])[0]
        if error is not None:
            raise error

    def validate_many(self, messages: Sequence[Sequence[Record]]) -> list[InvalidRecord | None]:
        """Validate several messages in order (a poll); per message, ``None`` or its error.

        The span columns of all messages are checked together, a handful of numpy passes over
        the whole poll, assuming every message's topologies count for the ones after it. Only
        if a column is out of range are the messages checked again one by one, so that the
        reason names the right message and record and a rejected topology counts for nothing.
        """
        self._now_ns = self.limits.now_ns()
        self._max_time_ns = self._now_ns + self.limits.max_future_ns
        before = dict(self._world_size)
        errors: list[InvalidRecord | None] = []
        deferred: list[tuple[_Columnar, int]] = []
        for records in messages:
            error = self._message(records, deferred)
            errors.append(error)
        if deferred and not self._columns_ok(deferred):
            self._world_size = before
            errors = [self._message(records, None) for records in messages]
        return errors

    def _message(self, records: Sequence[Record], deferred: list[tuple[_Columnar, int]] | None
                 ) -> InvalidRecord | None:
        """Check one message; with ``deferred``, leave the numeric columns of span and summary
        batches to :meth:`_columns_ok`."""
        declared: dict[str, int] = {}
        batches: list[tuple[_Columnar, int]] = []
        metric_ok, step_ok = self._metric_ok, self._step_ok
        for index, record in enumerate(records):
            try:
                # The high-volume records pass one combined test; only a failing one is
                # walked field by field, to name what is wrong.
                kind = type(record)
                if kind is MetricSample:
                    if metric_ok(record, declared):  # type: ignore[arg-type]
                        continue
                elif kind is StepRecord:
                    if step_ok(record, declared):  # type: ignore[arg-type]
                        continue
                elif deferred is not None and (
                    (kind is SpanBatch and self._batch_ok(record))  # type: ignore[arg-type]
                    or (kind is SummaryBatch
                        and self._summary_header_ok(record))  # type: ignore[arg-type]
                ):
                    if len(record):  # type: ignore[arg-type]
                        batches.append((record, self._rank_bound(record.job_id, declared)[0]))
                    continue
                self._check(record, declared)
            except _Bad as exc:
                return InvalidRecord(index, _kind(record), str(exc))
            except Exception as exc:  # a record built in Python may hold any type at all
                return InvalidRecord(
                    index, _kind(record), f"unusable values ({type(exc).__name__}: {exc})"
                )
        self._world_size.update(declared)
        if deferred is not None:
            deferred.extend(batches)
        return None

    def _columns_ok(self, batches: list[tuple[_Columnar, int]]) -> bool:
        """Every numeric column of every batch in range, in one pass per column."""
        spans = [(b, bound) for b, bound in batches if type(b) is SpanBatch]
        summaries = [(b, bound) for b, bound in batches if type(b) is SummaryBatch]
        return (not spans or self._span_columns_ok(spans)) and (
            not summaries or self._summary_columns_ok(summaries)
        )

    def _summary_columns_ok(self, batches: list[tuple[_Columnar, int]]) -> bool:
        lim = self.limits

        def joined(name: str) -> np.ndarray:
            dtype = _SUMMARY_DTYPES[name]
            return np.frombuffer(b"".join(getattr(b, name) for b, _ in batches), dtype=dtype)

        if not _ranks_below(joined("rank"), batches):
            return False
        count, low, high = joined("count"), joined("min_ns"), joined("max_ns")
        m2 = joined("m2_ns2")
        sketch_counts = joined("sketch_counts")
        # Joined offsets: between two batches the difference is <= 0, never a bucket count.
        buckets = np.diff(joined("sketch_offsets"))
        return bool(
            joined("total_ns").min() >= 0
            and low.min() >= 0 and low.max() <= lim.max_duration_ns
            and high.min() >= 0 and high.max() <= lim.max_duration_ns
            and joined("bytes_total").min() >= 0
            and np.isfinite(m2).all() and m2.min() >= 0
            and not ((count > 0) & (low > high)).any()
            and (len(buckets) == 0 or buckets.max() <= lim.max_sketch_buckets)
            and (len(sketch_counts) == 0 or sketch_counts.min() >= 0)
        )

    def _span_columns_ok(self, batches: list[tuple[_Columnar, int]]) -> bool:
        lim = self.limits

        def joined(name: str, dtype: str) -> np.ndarray:
            return np.frombuffer(b"".join(getattr(b, name) for b, _ in batches), dtype=dtype)

        rank_ok = _ranks_below(joined("rank", "<i4"), batches)
        start = joined("start_ns", "<i8")
        duration = joined("duration_ns", "<i8")
        moved = joined("bytes_moved", "<i8")  # empty columns (all zero) join as nothing
        return (
            rank_ok
            and joined("step", "<i4").min() >= -1
            and start.min() >= lim.min_time_ns
            and start.max() <= self._max_time_ns
            and duration.min() >= 0
            and duration.max() <= lim.max_duration_ns
            and (len(moved) == 0 or moved.min() >= 0)
        )

    # -- one record -----------------------------------------------------------------------

    def _batch_ok(self, b: SpanBatch) -> bool:
        """Everything but the numeric columns (see :meth:`_columns_ok`)."""
        lim = self.limits
        return (
            1 <= b.v <= SCHEMA_VERSION
            and 0 < len(b.job_id) <= lim.max_id_chars
            and len(b.host) <= lim.max_id_chars
            and len(b.names) <= lim.max_functions
            and (not b.names or (
                min(map(len, b.names)) > 0 and max(map(len, b.names)) <= lim.max_name_chars
                and min(map(len, b.layers)) > 0 and max(map(len, b.layers)) <= lim.max_id_chars
            ))
        )

    def _summary_header_ok(self, b: SummaryBatch) -> bool:
        """Everything but the numeric columns (see :meth:`_columns_ok`); the function
        dictionary is checked in full by :meth:`_summary_batch` the first time it is seen."""
        lim = self.limits
        return (
            1 <= b.v <= SCHEMA_VERSION
            and 0 < len(b.job_id) <= lim.max_id_chars
            and len(b.host) <= lim.max_id_chars
            and lim.min_time_ns <= b.window_start_ns <= self._max_time_ns
            and lim.min_time_ns <= b.window_end_ns <= self._max_time_ns
            and 0 <= b.window_end_ns - b.window_start_ns <= lim.max_duration_ns
            and len(b.names) <= lim.max_functions
            and (tuple(b.layers), tuple(b.names), tuple(b.callpaths)) in self._dictionaries_ok
        )

    def _metric_ok(self, s: MetricSample, declared: dict[str, int]) -> bool:
        lim = self.limits
        bound = declared.get(s.job_id) or self._world_size.get(s.job_id) or lim.max_ranks
        return (
            1 <= s.v <= SCHEMA_VERSION
            and 0 < len(s.job_id) <= lim.max_id_chars
            and -1 <= s.rank < bound
            and len(s.host) <= lim.max_id_chars
            and -1 <= s.device < lim.max_devices
            and lim.min_time_ns <= s.ts_ns <= self._max_time_ns
            and 0 < len(s.name) <= lim.max_id_chars
            and math.isfinite(s.value)
        )

    def _step_ok(self, s: StepRecord, declared: dict[str, int]) -> bool:
        lim = self.limits
        bound = declared.get(s.job_id) or self._world_size.get(s.job_id) or lim.max_ranks
        return (
            1 <= s.v <= SCHEMA_VERSION
            and 0 < len(s.job_id) <= lim.max_id_chars
            and 0 <= s.rank < bound
            and 0 <= s.step < 2**31
            and lim.min_time_ns <= s.start_ns <= self._max_time_ns
            and 0 <= s.duration_ns <= lim.max_duration_ns
            and 0 <= s.samples <= _INT64_MAX
            and 0 <= s.tokens <= _INT64_MAX
            and 0.0 <= s.seq_len_mean < math.inf
            and 0 <= s.seq_len_max <= _INT64_MAX
        )

    def _check(self, record: Record, declared: dict[str, int]) -> None:
        """Every check of the record, raising :class:`_Bad` at the first that fails."""
        if not 1 <= record.v <= SCHEMA_VERSION:
            raise _Bad(f"v={record.v} is not a schema version in [1, {SCHEMA_VERSION}]")
        self._text("job_id", record.job_id, self.limits.max_id_chars)
        if isinstance(record, SpanBatch):
            self._span_batch(record, declared)
        elif isinstance(record, StepRecord):
            self._step(record, declared)
        elif isinstance(record, MetricSample):
            self._metric(record, declared)
        elif isinstance(record, SummaryBatch):
            self._summary_batch(record, declared)
        elif isinstance(record, FunctionSummary):
            self._summary(record, declared)
        elif isinstance(record, SpanEvent):
            self._event(record, declared)
        elif isinstance(record, Topology):
            declared[record.job_id] = self._topology(record)
        elif isinstance(record, Finding):
            _number_in("score", record.score, 0.0, 1.0)
        elif isinstance(record, ControlMessage):
            _int_in("rank", record.rank, -1, self.limits.max_ranks - 1)
        elif isinstance(record, ProfileCallPaths):
            self._profile(record, declared)
        elif isinstance(record, FindingCallPath):
            self._rank(record.rank, record.job_id, declared)
            _number_in("score", record.score, 0.0, 1.0)

    def _rank_bound(self, job_id: str, declared: dict[str, int]) -> tuple[int, str]:
        world = declared.get(job_id) or self._world_size.get(job_id)
        if world is None:
            return self.limits.max_ranks, f"no topology known for job {job_id!r}"
        return world, f"job {job_id!r} declares a world size of {world}"

    def _rank(self, value: int, job_id: str, declared: dict[str, int], *, host_level: bool = False
              ) -> None:
        bound, why = self._rank_bound(job_id, declared)
        low = -1 if host_level else 0
        if not low <= value < bound:
            raise _Bad(f"rank={_short(value)} not in [{low}, {bound - 1}], {why}")

    def _time(self, name: str, value: int) -> None:
        _int_in(name, value, self.limits.min_time_ns, self._now_ns + self.limits.max_future_ns)

    def _duration(self, name: str, value: int) -> None:
        _int_in(name, value, 0, self.limits.max_duration_ns)

    def _text(self, name: str, value: str, limit: int, *, empty_ok: bool = False) -> None:
        if not value and not empty_ok:
            raise _Bad(f"{name} is empty")
        if len(value) > limit:
            raise _Bad(f"{name} has {len(value)} characters, more than {limit} "
                       f"(starts {_short(value[:20])})")

    def _function(self, layer: str, name: str) -> None:
        self._text("layer", layer, self.limits.max_id_chars)
        self._text("name", name, self.limits.max_name_chars)

    def _span_batch(self, batch: SpanBatch, declared: dict[str, int]) -> None:
        self._text("host", batch.host, self.limits.max_id_chars, empty_ok=True)
        if len(batch.names) > self.limits.max_functions:
            raise _Bad(f"{len(batch.names)} functions, more than {self.limits.max_functions}")
        for i, (layer, name) in enumerate(zip(batch.layers, batch.names, strict=True)):
            try:
                self._function(layer, name)
            except _Bad as exc:
                raise _Bad(f"function {i}: {exc}") from None
        if not len(batch):
            return
        rank_bound, why = self._rank_bound(batch.job_id, declared)
        _column_in(batch, "rank", 0, rank_bound - 1, why)
        _column_in(batch, "step", -1, 2**31 - 1)
        _column_in(batch, "start_ns", self.limits.min_time_ns,
                   self._now_ns + self.limits.max_future_ns)
        _column_in(batch, "duration_ns", 0, self.limits.max_duration_ns)
        if batch.bytes_moved:
            _column_in(batch, "bytes_moved", 0, _INT64_MAX)

    def _event(self, event: SpanEvent, declared: dict[str, int]) -> None:
        self._rank(event.rank, event.job_id, declared)
        self._function(event.layer, event.name)
        self._time("start_ns", event.start_ns)
        self._duration("duration_ns", event.duration_ns)
        _int_in("step", event.step, -1, 2**31 - 1)
        _int_in("bytes_moved", event.bytes_moved, 0, _INT64_MAX)
        _int_in("callpath_id", event.callpath_id, 0, _UINT64_MAX)

    def _step(self, step: StepRecord, declared: dict[str, int]) -> None:
        self._rank(step.rank, step.job_id, declared)
        _int_in("step", step.step, 0, 2**31 - 1)
        self._time("start_ns", step.start_ns)
        self._duration("duration_ns", step.duration_ns)
        _int_in("samples", step.samples, 0, _INT64_MAX)
        _int_in("tokens", step.tokens, 0, _INT64_MAX)
        _number_in("seq_len_mean", step.seq_len_mean, 0.0, math.inf)
        _int_in("seq_len_max", step.seq_len_max, 0, _INT64_MAX)

    def _metric(self, sample: MetricSample, declared: dict[str, int]) -> None:
        self._rank(sample.rank, sample.job_id, declared, host_level=True)
        self._text("host", sample.host, self.limits.max_id_chars, empty_ok=True)
        _int_in("device", sample.device, -1, self.limits.max_devices - 1)
        self._time("ts_ns", sample.ts_ns)
        self._text("name", sample.name, self.limits.max_id_chars)
        _number_in("value", sample.value, -math.inf, math.inf)

    def _summary(self, summary: FunctionSummary, declared: dict[str, int]) -> None:
        self._rank(summary.rank, summary.job_id, declared)
        self._function(summary.layer, summary.name)
        _int_in("callpath_id", summary.callpath_id, 0, _UINT64_MAX)
        self._time("window_start_ns", summary.window_start_ns)
        self._time("window_end_ns", summary.window_end_ns)
        self._duration("window length", summary.window_end_ns - summary.window_start_ns)
        _int_in("count", summary.count, 0, _INT64_MAX)
        _int_in("total_ns", summary.total_ns, 0, _INT64_MAX)
        _number_in("m2_ns2", summary.m2_ns2, 0.0, math.inf)
        self._duration("min_ns", summary.min_ns)
        self._duration("max_ns", summary.max_ns)
        if summary.count and summary.min_ns > summary.max_ns:
            raise _Bad(f"min_ns={summary.min_ns} is above max_ns={summary.max_ns}")
        _int_in("bytes_total", summary.bytes_total, 0, _INT64_MAX)
        if len(summary.sketch_keys) > self.limits.max_sketch_buckets:
            raise _Bad(f"sketch has {len(summary.sketch_keys)} buckets, more than "
                       f"{self.limits.max_sketch_buckets}")
        for i, (key, count) in enumerate(zip(summary.sketch_keys, summary.sketch_counts,
                                              strict=True)):
            _int_in(f"sketch_keys[{i}]", key, -(2**31), 2**31 - 1)
            _int_in(f"sketch_counts[{i}]", count, 0, _INT64_MAX)

    def _summary_batch(self, batch: SummaryBatch, declared: dict[str, int]) -> None:
        """The row summary's checks, one numpy pass per column (decoding already checked that
        the columns agree in length and that function indices and counts are in range)."""
        self._text("host", batch.host, self.limits.max_id_chars, empty_ok=True)
        self._time("window_start_ns", batch.window_start_ns)
        self._time("window_end_ns", batch.window_end_ns)
        self._duration("window length", batch.window_end_ns - batch.window_start_ns)
        if len(batch.names) > self.limits.max_functions:
            raise _Bad(f"{len(batch.names)} functions, more than {self.limits.max_functions}")
        # Every rank sends the same function dictionary window after window: check each
        # distinct one once (bounded, like the window engine's cache of them).
        dictionary = (tuple(batch.layers), tuple(batch.names), tuple(batch.callpaths))
        if dictionary not in self._dictionaries_ok:
            for i, (layer, name, path) in enumerate(zip(*dictionary, strict=True)):
                try:
                    self._function(layer, name)
                    _int_in("callpath_id", path, 0, _UINT64_MAX)
                except _Bad as exc:
                    raise _Bad(f"function {i}: {exc}") from None
            if len(self._dictionaries_ok) >= _MAX_DICTIONARIES:
                self._dictionaries_ok.clear()
            self._dictionaries_ok.add(dictionary)
        if not len(batch):
            return
        rank_bound, why = self._rank_bound(batch.job_id, declared)
        _column_in(batch, "rank", 0, rank_bound - 1, why)
        _column_in(batch, "total_ns", 0, _INT64_MAX)
        _column_in(batch, "min_ns", 0, self.limits.max_duration_ns)
        _column_in(batch, "max_ns", 0, self.limits.max_duration_ns)
        _column_in(batch, "bytes_total", 0, _INT64_MAX)
        m2 = batch.column("m2_ns2")
        if not (np.isfinite(m2).all() and m2.min() >= 0):
            i = int(np.flatnonzero(~np.isfinite(m2) | (m2 < 0))[0])
            raise _Bad(f"m2_ns2[{i}]={float(m2[i])!r} is not a finite number >= 0")
        inverted = (batch.column("count") > 0) & (batch.column("min_ns") > batch.column("max_ns"))
        if inverted.any():
            i = int(np.flatnonzero(inverted)[0])
            raise _Bad(f"min_ns[{i}]={int(batch.column('min_ns')[i])} is above "
                       f"max_ns[{i}]={int(batch.column('max_ns')[i])}")
        buckets = np.diff(batch.column("sketch_offsets"))
        if buckets.max() > self.limits.max_sketch_buckets:
            i = int(np.argmax(buckets))
            raise _Bad(f"sketch of row {i} has {int(buckets[i])} buckets, more than "
                       f"{self.limits.max_sketch_buckets}")
        if len(batch.sketch_counts):
            _column_in(batch, "sketch_counts", 0, _INT64_MAX)

    def _profile(self, p: ProfileCallPaths, declared: dict[str, int]) -> None:
        """A profile session's call-path tree (rare and small: checked row by row)."""
        lim = self.limits
        self._rank(p.rank, p.job_id, declared)
        self._text("request_id", p.request_id, lim.max_id_chars, empty_ok=True)
        self._time("started_ns", p.started_ns)
        self._time("stopped_ns", p.stopped_ns)
        self._duration("session length", p.stopped_ns - p.started_ns)
        _int_in("steps", p.steps, 0, 2**31 - 1)
        _int_in("parts", p.parts, 1, lim.max_functions)
        if len(p) > lim.max_functions:
            raise _Bad(f"{len(p)} call paths, more than {lim.max_functions}")
        rows = zip(p.callpaths, p.parents, p.layers, p.names, p.counts, p.total_ns, p.self_ns,
                   strict=True)
        for i, (cp, parent, layer, name, count, total, own) in enumerate(rows):
            try:
                self._function(layer, name)
                _int_in("callpath", cp, 1, _UINT64_MAX)
                _int_in("parent", parent, 0, _UINT64_MAX)
                _int_in("count", count, 0, _INT64_MAX)
                _int_in("total_ns", total, 0, _INT64_MAX)
                _int_in("self_ns", own, 0, total)
            except _Bad as exc:
                raise _Bad(f"call path {i}: {exc}") from None

    def _topology(self, topology: Topology) -> int:
        world = topology.world_size
        if world > self.limits.max_ranks:
            raise _Bad(f"world size {_short(world)} (dp {topology.dp_size} x pp "
                       f"{topology.pp_size} x tp {topology.tp_size} x cp {topology.cp_size}) "
                       f"is more than {self.limits.max_ranks}")
        if len(topology.workers) > world:
            raise _Bad(f"{len(topology.workers)} workers for a world size of {world}")
        for i, w in enumerate(topology.workers):
            try:
                _int_in("rank", w.rank, 0, world - 1)
                _int_in("dp_rank", w.dp_rank, 0, topology.dp_size - 1)
                _int_in("pp_stage", w.pp_stage, 0, topology.pp_size - 1)
                _int_in("tp_rank", w.tp_rank, 0, topology.tp_size - 1)
                _int_in("cp_rank", w.cp_rank, 0, topology.cp_size - 1)
                _int_in("local_rank", w.local_rank, 0, self.limits.max_devices - 1)
                self._text("host", w.host, self.limits.max_id_chars, empty_ok=True)
            except _Bad as exc:
                raise _Bad(f"workers[{i}]: {exc}") from None
        return world


# Function dictionaries of summary batches remembered as valid (cleared when full).
_MAX_DICTIONARIES = 4096
_SUMMARY_DTYPES = {**SUMMARY_COLUMNS, **SUMMARY_SKETCH_COLUMNS}
_Columnar = SpanBatch | SummaryBatch


def _ranks_below(rank: np.ndarray, batches: list[tuple[_Columnar, int]]) -> bool:
    """Every rank >= 0 and below its batch's bound (the job's world size, or the limit)."""
    if rank.min() < 0:
        return False
    bounds = {bound for _, bound in batches}
    if len(bounds) == 1:
        return bool(rank.max() < bounds.pop())
    limit = np.repeat([bound for _, bound in batches], [len(b) for b, _ in batches])
    return bool((rank < limit).all())


def _int_in(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise _Bad(f"{name}={_short(value)} not in [{lo}, {hi}]")


def _number_in(name: str, value: float, lo: float, hi: float) -> None:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise _Bad(f"{name}={value!r} is not a finite number in [{lo}, {hi}]")


def _column_in(batch: SpanBatch | SummaryBatch, name: str, lo: int, hi: int, why: str = "") -> None:
    column = batch.column(name)
    if column.min() >= lo and column.max() <= hi:
        return
    i = int(np.flatnonzero((column < lo) | (column > hi))[0])
    suffix = f", {why}" if why else ""
    raise _Bad(f"{name}[{i}]={int(column[i])} not in [{lo}, {hi}]{suffix}")


def _kind(record: object) -> str:
    config = getattr(type(record), "__struct_config__", None)
    return str(config.tag) if config is not None else type(record).__name__


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
