"""Semantic checks on decoded records: what msgspec's type checks cannot know.

Decoding proves a record has the right shape; it does not prove the values are usable. A rank of
2**40, a timestamp of 0, a NaN reading or a 1 MB function name all decode, and each one would
make a later stage allocate, overflow or mislead a detector. :class:`Validator` checks every
field against :class:`Limits` before a record reaches the window engine.

Every rule is written once, in :data:`RULES` (one :class:`~trainscope.schemas.rules.Kind` per
record kind); :mod:`trainscope.schemas.rules` derives from it both the fast check and the check
that explains a failure.

Policy: a bus message is accepted or rejected **whole**. One bad record sets aside the entire
message (with a reason naming the record index, field and value), so a message is never half
applied and a dead letter can be replayed as the unit it was sent as.

Ranks are checked against the job's world size once its :class:`Topology` is known (a topology
earlier in the same message counts), and against ``Limits.max_ranks`` before that.

Cost: each record passes one compiled test of all its fields; the span and summary columns of a
whole poll are joined and checked in a few numpy passes (never a Python loop per event); only a
message that fails is walked rule by rule to name the problem. See
:meth:`Validator.validate_many`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from trainscope.schemas.records import (
    SCHEMA_VERSION,
    SPAN_COLUMNS,
    SUMMARY_COLUMNS,
    SUMMARY_SKETCH_COLUMNS,
    ControlMessage,
    Finding,
    FindingCallPath,
    FunctionSummary,
    MetricBatch,
    MetricSample,
    ProfileCallPaths,
    Record,
    SpanBatch,
    SpanEvent,
    StepBatch,
    StepRecord,
    SummaryBatch,
    Topology,
)
from trainscope.schemas.rules import (
    I16_MAX,
    I16_MIN,
    I32_MAX,
    I64_MAX,
    LAST_RANK,
    LATEST_NS,
    U32_MAX,
    U64_MAX,
    Checks,
    Diff,
    Gaps,
    Group,
    Int,
    Kind,
    Len,
    Limit,
    Number,
    Ordered,
    Ref,
    Row,
    Text,
    rank_bound,
)
from trainscope.schemas.step_metric import METRIC_BATCH_COLUMNS, STEP_BATCH_COLUMNS

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


# -- the rules, each written once -----------------------------------------------------------

_ID_CHARS = Limit("max_id_chars")
_DURATION = Limit("max_duration_ns")
_FUNCTIONS = Limit("max_functions")


def _time(name: str) -> Int:
    return Int(name, Limit("min_time_ns"), LATEST_NS)


def _duration(name: str) -> Int:
    return Int(name, 0, _DURATION)


_COMMON = (
    Int("v", 1, SCHEMA_VERSION, reason="v={value} is not a schema version in [{lo}, {hi}]"),
    Text("job_id", 1, _ID_CHARS),
)
_HOST = Text("host", 0, _ID_CHARS)
_RANK = Int("rank", 0, LAST_RANK)
_FUNCTION = (Text("layer", 1, _ID_CHARS), Text("name", 1, Limit("max_name_chars")))
_CALLPATH = Int("callpath_id", 0, U64_MAX)
_FUNCTION_COUNT = Int(Len("names"), None, _FUNCTIONS, reason="{value} functions, more than {hi}")
_WINDOW = (_time("window_start_ns"), _time("window_end_ns"),
           _duration(Diff("window length", "window_end_ns", "window_start_ns")))
# A span's values: fields of a SpanEvent, columns of a SpanBatch.
_SPAN = (_RANK, Int("step", -1, I32_MAX), _time("start_ns"), _duration("duration_ns"),
         Int("bytes_moved", 0, I64_MAX), _CALLPATH)
# A function summary's values: fields of a FunctionSummary, columns of a SummaryBatch (in
# this order, a poll's joined min_ns, max_ns and count columns are freed soon after joining).
_SUMMARY = (_RANK, _duration("min_ns"), _duration("max_ns"), Int("count", 0, I64_MAX),
            Ordered("min_ns", "max_ns", when="count"), Int("total_ns", 0, I64_MAX),
            Number("m2_ns2", 0.0), Int("bytes_total", 0, I64_MAX))
# A step record's values: fields of a StepRecord, columns of a StepBatch.
_STEP = (_RANK, Int("step", 0, I32_MAX), _time("start_ns"), _duration("duration_ns"),
         Int("samples", 0, I64_MAX), Int("tokens", 0, I64_MAX), Number("seq_len_mean", 0.0),
         Int("seq_len_max", 0, I64_MAX), Int("collective_ns", 0, I64_MAX),
         Int("device_collective_ns", 0, I64_MAX))
# A metric sample's values (its host and name aside): fields of a MetricSample, columns of a
# MetricBatch.
_METRIC = (Int("rank", -1, LAST_RANK), Int("device", -1, Limit("max_devices", 1)), _time("ts_ns"),
           Number("value"))
# The store's types (trainscope.schemas.ddl): every key ceil(log_gamma(ns)) of an Int64
# duration lies within Int16, and a bucket's count in one window within UInt32.
_SKETCH = (Int("sketch_keys", I16_MIN, I16_MAX), Int("sketch_counts", 0, U32_MAX))
_BUCKETS = Limit("max_sketch_buckets")
_WORKER = (
    Int("rank", 0, Ref("world_size", 1)),
    Int("dp_rank", 0, Ref("dp_size", 1)),
    Int("pp_stage", 0, Ref("pp_size", 1)),
    Int("tp_rank", 0, Ref("tp_size", 1)),
    Int("cp_rank", 0, Ref("cp_size", 1)),
    Int("local_rank", 0, Limit("max_devices", 1)),
    _HOST,
)
_CALL_PATH_ROW = (*_FUNCTION, Int("callpath", 1, U64_MAX), Int("parent", 0, U64_MAX),
                  Int("count", 0, I64_MAX), Int("total_ns", 0, I64_MAX),
                  Int("self_ns", 0, Row("total_ns")))

RULES: dict[type, Kind] = {
    SpanEvent: Kind(fields=(*_COMMON, *_SPAN, *_FUNCTION)),
    SpanBatch: Kind(
        fields=(*_COMMON, _HOST, _FUNCTION_COUNT),
        groups=(Group("function {i}", (("layer", "layers"), ("name", "names")), _FUNCTION),),
        columns=_SPAN, dtypes=SPAN_COLUMNS,
    ),
    StepRecord: Kind(fields=(*_COMMON, *_STEP)),
    StepBatch: Kind(fields=_COMMON, columns=_STEP, dtypes=STEP_BATCH_COLUMNS),
    MetricSample: Kind(fields=(*_COMMON, _HOST, Text("name", 1, _ID_CHARS), *_METRIC)),
    MetricBatch: Kind(
        fields=(*_COMMON,
                Int(Len("hosts"), None, _FUNCTIONS, reason="{value} hosts, more than {hi}"),
                Int(Len("names"), None, _FUNCTIONS,
                    reason="{value} metric names, more than {hi}")),
        groups=(Group("host {i}", (("host", "hosts"),), (_HOST,), memo=True),
                Group("metric name {i}", (("name", "names"),), (Text("name", 1, _ID_CHARS),),
                      memo=True)),
        columns=_METRIC, dtypes=METRIC_BATCH_COLUMNS,
    ),
    FunctionSummary: Kind(
        fields=(*_COMMON, *_SUMMARY, *_FUNCTION, _CALLPATH, *_WINDOW,
                Int(Len("sketch_keys"), None, _BUCKETS,
                    reason="sketch has {value} buckets, more than {hi}")),
        groups=(Group(None, (("sketch_keys", "sketch_keys"), ("sketch_counts", "sketch_counts")),
                      _SKETCH),),
    ),
    SummaryBatch: Kind(
        fields=(*_COMMON, _HOST, *_WINDOW, _FUNCTION_COUNT),
        groups=(Group("function {i}", (("layer", "layers"), ("name", "names"),
                                       ("callpath_id", "callpaths")), (*_FUNCTION, _CALLPATH),
                      memo=True),),
        columns=(*_SUMMARY, *_SKETCH,
                 Int(Gaps("sketch_offsets", "sketch"), None, _BUCKETS,
                     reason="sketch of row {i} has {value} buckets, more than {hi}")),
        dtypes={**SUMMARY_COLUMNS, **SUMMARY_SKETCH_COLUMNS},
    ),
    Topology: Kind(
        fields=(*_COMMON,
                Int("world_size", None, Limit("max_ranks"),
                    reason="world size {value} (dp {r.dp_size} x pp {r.pp_size} x tp "
                           "{r.tp_size} x cp {r.cp_size}) is more than {hi}"),
                Int(Len("workers"), None, Ref("world_size"),
                    reason="{value} workers for a world size of {hi}")),
        groups=(Group("workers[{i}]", "workers", _WORKER),),
        declares="world_size",
    ),
    Finding: Kind(fields=(*_COMMON, Number("score", 0.0, 1.0))),
    ControlMessage: Kind(fields=(*_COMMON, Int("rank", -1, Limit("max_ranks", 1)))),
    ProfileCallPaths: Kind(
        fields=(*_COMMON, _RANK, Text("request_id", 0, _ID_CHARS), _time("started_ns"),
                _time("stopped_ns"),
                _duration(Diff("session length", "stopped_ns", "started_ns")),
                Int("steps", 0, I32_MAX), Int("parts", 1, _FUNCTIONS),
                Int(Len("callpaths"), None, _FUNCTIONS,
                    reason="{value} call paths, more than {hi}")),
        groups=(Group("call path {i}", (
            ("layer", "layers"), ("name", "names"), ("callpath", "callpaths"),
            ("parent", "parents"), ("count", "counts"), ("total_ns", "total_ns"),
            ("self_ns", "self_ns")), _CALL_PATH_ROW),),
    ),
    FindingCallPath: Kind(fields=(*_COMMON, _RANK, Number("score", 0.0, 1.0))),
}


@lru_cache(maxsize=32)
def checks_for(limits: Limits) -> dict[type, Checks]:
    """Every kind's checks for these limits (compiled once: validators are made per job and per
    test, limits rarely differ)."""
    return {kind: Checks(rules, limits, _tag(kind)) for kind, rules in RULES.items()}


# -- the validator ----------------------------------------------------------------------------


class InvalidRecord(ValueError):
    """One record of a message failed a check; ``str()`` is the one-line dead-letter reason."""

    def __init__(self, index: int, kind: str, detail: str) -> None:
        self.index = index
        self.kind = kind
        self.detail = detail
        super().__init__(f"records[{index}] ({kind}): {detail}")


# Where the fast check rejects a record whose rules all pass one by one: never, unless the
# two checks disagree (a bug; the record is rejected rather than let through unchecked).
UNNAMED = "failed the combined check, yet no single rule names it (please report)"

# A batch whose numeric columns wait for the poll-wide check, with its job's rank bound ...
_Deferred = tuple[SpanBatch | SummaryBatch, int]
# ... and, while its message is checked, its index and why the rank bound is what it is.
_Waiting = tuple[int, SpanBatch | SummaryBatch, int, str]


class Validator:
    """Checks records against :class:`Limits` and remembers each job's declared world size."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits if limits is not None else Limits()
        self._checks = checks_for(self.limits)
        # The kinds whose fast check is all there is to them (no columns, no world size).
        self._plain = {kind: c.ok for kind, c in self._checks.items()
                       if not c.columnar and not c.declares}
        # The batch kinds whose columns wait for the poll-wide check: their fast check, then
        # the rank bound (most messages of a large job are a batch or two of these).
        self._columnar = {kind: c.ok for kind, c in self._checks.items()
                          if c.columnar and not c.declares}
        self._world_size: dict[str, int] = {}
        self._latest_ns = self.limits.now_ns() + self.limits.max_future_ns

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
        self._latest_ns = self.limits.now_ns() + self.limits.max_future_ns
        before = dict(self._world_size)
        deferred: list[_Deferred] = []
        errors = [self._message(records, deferred) for records in messages]
        if deferred and not self._columns_ok(deferred):
            self._world_size = before
            errors = [self._message(records, None) for records in messages]
        return errors

    def explain(self, records: Sequence[Record]) -> InvalidRecord | None:
        """The reference verdict on one message: every rule of every record tried one at a
        time, columns searched element by element, none of the combined tests.

        Slow; what :meth:`validate_many` must agree with (the agreement test compares them).
        World sizes are read, not remembered.
        """
        self._latest_ns = self.limits.now_ns() + self.limits.max_future_ns
        declared: dict[str, int] = {}
        for index, record in enumerate(records):
            try:
                checks = self._checks_of(record)
                reason = checks.explain(record, declared, self._world_size, self._latest_ns)
                if reason is None and checks.columnar:
                    end, why = self._rank_bound(record.job_id, declared)
                    reason = checks.column_reason(record, end, why, self._latest_ns)
                if reason is None and checks.declares:
                    declared[record.job_id] = getattr(record, checks.declares)
            except Exception as exc:  # a record built in Python may hold any type at all
                reason = f"unusable values ({type(exc).__name__}: {exc})"
            if reason is not None:
                return InvalidRecord(index, _kind(record), reason)
        return None

    def _message(self, records: Sequence[Record], deferred: list[_Deferred] | None
                 ) -> InvalidRecord | None:
        """Check one message; with ``deferred``, leave the numeric columns of span and summary
        batches to :meth:`_columns_ok`."""
        declared: dict[str, int] = {}
        batches: list[_Waiting] = []
        world, latest_ns, plain = self._world_size, self._latest_ns, self._plain
        columnar = self._columnar if deferred is not None else {}
        for index, record in enumerate(records):
            # Most records are rows that pass: one dict lookup and one compiled test.
            kind = type(record)
            ok = plain.get(kind)
            try:
                if ok is not None and ok(record, declared, world, latest_ns):
                    continue
                # ... or batches that pass theirs, their columns left for the poll.
                ok = columnar.get(kind)
                if ok is not None and ok(record, declared, world, latest_ns):
                    if len(record):
                        end, why = self._rank_bound(record.job_id, declared)
                        batches.append((index, record, end, why))
                    continue
            except Exception:
                pass  # the explaining check names the value that raised
            waiting = batches if deferred is not None else None
            reason = self._record(index, record, declared, waiting)
            if reason is not None:
                # A batch before it with a bad column is the message's first bad record.
                return self._first_bad_batch(batches) or InvalidRecord(index, _kind(record),
                                                                        reason)
        self._world_size.update(declared)
        if deferred is not None:
            deferred.extend((batch, end) for _, batch, end, _ in batches)
        return None

    def _record(self, index: int, record: Record, declared: dict[str, int],
                waiting: list[_Waiting] | None) -> str | None:
        """One record that is not a plain row that passed: a batch (its columns checked now, or
        left ``waiting``), a topology (declaring its world size), or a failure to explain."""
        world, latest_ns = self._world_size, self._latest_ns
        try:
            checks = self._checks_of(record)
            try:
                passed = checks.ok(record, declared, world, latest_ns)
            except Exception:
                passed = False
            if not passed:
                return checks.explain(record, declared, world, latest_ns) or UNNAMED
            if checks.columnar:
                end, why = self._rank_bound(record.job_id, declared)
                if waiting is not None:
                    if len(record):  # type: ignore[arg-type]
                        waiting.append((index, record, end, why))  # type: ignore[arg-type]
                elif not checks.columns_ok([(record, end)], latest_ns):
                    return checks.column_reason(record, end, why, latest_ns) or UNNAMED
            if checks.declares:
                declared[record.job_id] = getattr(record, checks.declares)
        except Exception as exc:  # a record built in Python may hold any type at all
            return f"unusable values ({type(exc).__name__}: {exc})"
        return None

    def _first_bad_batch(self, batches: list[_Waiting]) -> InvalidRecord | None:
        for index, batch, end, why in batches:
            checks = self._checks[type(batch)]
            if not checks.columns_ok([(batch, end)], self._latest_ns):
                reason = checks.column_reason(batch, end, why, self._latest_ns) or UNNAMED
                return InvalidRecord(index, _kind(batch), reason)
        return None

    def _columns_ok(self, batches: list[_Deferred]) -> bool:
        """Every numeric column of every batch in range, a few numpy passes per column."""
        by_kind: dict[type, list[_Deferred]] = {}
        for batch, end in batches:
            by_kind.setdefault(type(batch), []).append((batch, end))
        return all(self._checks[kind].columns_ok(of_kind, self._latest_ns)
                   for kind, of_kind in by_kind.items())

    def _checks_of(self, record: object) -> Checks:
        checks = self._checks.get(type(record))
        if checks is not None:
            return checks
        for kind in type(record).__mro__:
            if kind in self._checks:
                return self._checks[kind]
        raise TypeError(f"{type(record).__name__} is not a record kind")

    def _rank_bound(self, job_id: str, declared: dict[str, int]) -> tuple[int, str]:
        return rank_bound(job_id, declared, self._world_size, self.limits.max_ranks)


def _tag(kind: type) -> str:
    config = getattr(kind, "__struct_config__", None)
    return str(config.tag) if config is not None else kind.__name__


def _kind(record: object) -> str:
    return _tag(type(record))
