"""ClickHouse tables, derived from the record structs so the two cannot drift apart.

Each table names the struct whose fields become its columns, the columns that are computed
or stored differently, and its engine keys. Every table is a ReplacingMergeTree with insert
deduplication on, so a batch delivered twice (at-least-once delivery) neither doubles rows at
insert time nor after a merge.

Layout (``LAYOUT_VERSION`` 3): every ``*_ns`` time keeps its ``Int64`` of nanoseconds, which
the code and the wire format use, and gets a ``DateTime64(9, 'UTC')`` twin without the suffix
(``window_start``, ``start``, ``ts``, ``received``) for Grafana's time macros and
``toStartOfMinute``. The twins are ``ALIAS`` columns: computed when read, so they cost no bytes
(stored as ``MATERIALIZED``, one made metric_samples 40% bigger), are left out of ``SELECT *`` (rows
still map onto the structs), and a filter on them still prunes the day partitions, whose key
is the same expression. Repeated strings are ``LowCardinality``; time series tables are
partitioned by day (a retention TTL drops whole days, see :func:`ttl_clause`); time and value
columns carry codecs for their shape. A quantile sketch's keys are ``Int16`` and its counts
``UInt32`` (the wire's are 32 and 64 bits): every key a duration can have fits, and the sink
saturates a count above ``UInt32``'s range and counts it (:class:`~trainscope.sinks.clickhouse.
SinkStats`).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass, field
from functools import cached_property

import msgspec

from trainscope.schemas.records import (
    ControlMessage,
    Finding,
    FindingCallPath,
    FunctionSummary,
    MetricBatch,
    MetricSample,
    ProfileCallPaths,
    SpanBatch,
    SpanEvent,
    StepBatch,
    StepRecord,
    SummaryBatch,
    Topology,
)

_SCALARS: dict[type, str] = {int: "Int64", float: "Float64", str: "String", bool: "Bool"}

# The table layout of this module; stores record theirs in ``store_layout`` (see
# :mod:`trainscope.sinks.store_layout`). 1: every time an Int64 of ns, no partitions, no codecs;
# 2: the sketches' keys and counts as 64-bit arrays.
LAYOUT_VERSION = 3
LOW_CARDINALITY = "LowCardinality(String)"
# Sorted timestamps: small differences (Delta measured smaller than DoubleDelta on demo jobs).
TIME_CODEC = "CODEC(Delta, ZSTD(1))"
# Durations and counts: small integers in wide columns.
INT_CODEC = "CODEC(T64, ZSTD(1))"
# Readings that change slowly: XOR with the previous value leaves few bits.
FLOAT_CODEC = "CODEC(Gorilla, ZSTD(1))"


def datetime_of(column_ns: str) -> str:
    """The type of the computed ``DateTime64(9, 'UTC')`` twin of an ``Int64`` ns column."""
    return f"DateTime64(9, 'UTC') ALIAS fromUnixTimestamp64Nano({column_ns}, 'UTC')"


def day_of(column_ns: str) -> str:
    """The UTC day of an ``Int64`` ns column: the partition key of time series tables."""
    return f"toDate(fromUnixTimestamp64Nano({column_ns}, 'UTC'))"


@dataclass(frozen=True)
class Table:
    name: str
    struct: type[msgspec.Struct]
    order_by: tuple[str, ...]
    # Struct fields stored under another ClickHouse type than the default mapping.
    types: dict[str, str] = field(default_factory=dict)
    # Struct fields not stored (derivable or nested) and extra columns stored alongside.
    skip: tuple[str, ...] = ()
    extra: dict[str, str] = field(default_factory=dict)
    # Column → ``CODEC(…)`` (struct fields and extra columns alike).
    codecs: dict[str, str] = field(default_factory=dict)
    # The ns column whose day partitions the table and whose age a TTL measures.
    time_column: str = ""

    @cached_property
    def insert_columns(self) -> tuple[str, ...]:
        """Columns a writer supplies: all but the ones ClickHouse computes itself."""
        return tuple(c for c, t in self.columns().items()
                     if "MATERIALIZED" not in t and " ALIAS " not in t)

    def columns(self) -> dict[str, str]:
        cols: dict[str, str] = {}
        hints = typing.get_type_hints(self.struct)
        for name in self.struct.__struct_fields__:
            if name in self.skip:
                continue
            cols[name] = self.types.get(name) or clickhouse_type(hints[name])
        cols.update(self.extra)
        return cols

    def ddl(self) -> str:
        cols = ",\n    ".join(
            f"`{name}` {ctype}" + (f" {self.codecs[name]}" if name in self.codecs else "")
            for name, ctype in self.columns().items()
        )
        partition = f"\nPARTITION BY {day_of(self.time_column)}" if self.time_column else ""
        return (
            f"CREATE TABLE IF NOT EXISTS {self.name} (\n    {cols}\n)\n"
            f"ENGINE = ReplacingMergeTree{partition}\n"
            f"ORDER BY ({', '.join(self.order_by)})\n"
            # Block-level insert deduplication for non-replicated tables: a re-sent batch
            # (same rows, same order) is dropped at insert time. A retention TTL drops whole
            # expired day partitions instead of rewriting parts.
            "SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1"
        )


def clickhouse_type(hint: object) -> str:
    origin = typing.get_origin(hint)
    if hint in _SCALARS:
        return _SCALARS[hint]  # type: ignore[index]
    if origin is list:
        (item,) = typing.get_args(hint)
        return f"Array({clickhouse_type(item)})"
    if origin is dict:
        key, value = typing.get_args(hint)
        return f"Map({clickhouse_type(key)}, {clickhouse_type(value)})"
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"no ClickHouse type for union {hint}")
    raise TypeError(f"no ClickHouse type for {hint}")


LC = LOW_CARDINALITY
WINDOW_TIMES = {"window_start": datetime_of("window_start_ns"),
                "window_end": datetime_of("window_end_ns")}

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            name="function_summaries",
            struct=FunctionSummary,
            order_by=("job_id", "window_start_ns", "rank", "layer", "name", "callpath_id"),
            # A sketch's keys are ceil(log_gamma(ns)): every Int64 duration's fits in Int16
            # (at most 2,184); a bucket's count in one window, in UInt32. Narrower than the wire's
            # types, they halve the table and its insert (benchmarks/README.md, store size).
            types={"job_id": LC, "layer": LC, "name": LC, "callpath_id": "UInt64",
                   "sketch_keys": "Array(Int16)", "sketch_counts": "Array(UInt32)"},
            extra={"mean_ns": "Float64 MATERIALIZED if(count = 0, 0, total_ns / count)",
                   **WINDOW_TIMES},
            codecs={"window_start_ns": TIME_CODEC, "window_end_ns": TIME_CODEC,
                    "count": INT_CODEC, "total_ns": INT_CODEC, "min_ns": INT_CODEC,
                    "max_ns": INT_CODEC, "bytes_total": INT_CODEC, "m2_ns2": FLOAT_CODEC,
                    "sketch_keys": "CODEC(ZSTD(1))", "sketch_counts": "CODEC(ZSTD(1))"},
            time_column="window_start_ns",
        ),
        Table(
            name="step_records",
            struct=StepRecord,
            order_by=("job_id", "rank", "step"),
            types={"job_id": LC},
            extra={"start": datetime_of("start_ns")},
            codecs={"step": "CODEC(Delta, ZSTD(1))", "start_ns": TIME_CODEC,
                    "duration_ns": INT_CODEC, "collective_ns": INT_CODEC,
                    "device_collective_ns": INT_CODEC},
            time_column="start_ns",
        ),
        Table(
            name="metric_samples",
            struct=MetricSample,
            order_by=("job_id", "name", "rank", "device", "ts_ns"),
            types={"job_id": LC, "host": LC, "name": LC},
            extra={"ts": datetime_of("ts_ns")},
            codecs={"ts_ns": TIME_CODEC, "value": FLOAT_CODEC},
            time_column="ts_ns",
        ),
        Table(
            name="findings",
            struct=Finding,
            order_by=("job_id", "window_start_ns", "detector", "rank", "pp_stage", "function"),
            types={"job_id": LC, "detector": LC, "layer": LC, "function": LC, "category": LC},
            extra=WINDOW_TIMES,
            time_column="window_start_ns",
        ),
        # The call path that explains a finding, from the stream job's automatic profile of the
        # suspect and a peer (trainscope pipeline --auto-profile). A table beside findings,
        # not columns of it: a finding is written with its window; its profile arrives later.
        Table(
            name="finding_call_paths",
            struct=FindingCallPath,
            order_by=("job_id", "window_start_ns", "detector", "rank", "category"),
            types={"callpath_id": "UInt64", "job_id": LC, "detector": LC, "category": LC},
            extra=WINDOW_TIMES,
            time_column="window_start_ns",
        ),
        Table(
            name="topologies",
            struct=Topology,
            order_by=("job_id",),
            skip=("workers",),
            extra={
                "ranks": "Array(Int64)",
                "hosts": "Array(String)",
                "dp_ranks": "Array(Int64)",
                "pp_stages": "Array(Int64)",
                "tp_ranks": "Array(Int64)",
                "cp_ranks": "Array(Int64)",
            },
        ),
    )
}

# Records that travel on the bus but are not stored as such: spans and summary batches become
# rows of function_summaries once windowed; control messages are addressed to producers; the
# call-path trees of on-demand profiles become rows of call_paths.
BUS_ONLY: tuple[type[msgspec.Struct], ...] = (
    SpanEvent, SpanBatch, SummaryBatch, StepBatch, MetricBatch, ControlMessage,
    ProfileCallPaths,
)

DEAD_LETTERS_DDL = f"""CREATE TABLE IF NOT EXISTS dead_letters (
    `received_ns` Int64,
    `topic` LowCardinality(String),
    `partition` Int64,
    `offset` Int64,
    `error` String,
    `payload` String,
    `received` {datetime_of("received_ns")},
    `payload_bytes` UInt64,
    `payload_sha256` String
)
ENGINE = MergeTree
PARTITION BY {day_of("received_ns")}
ORDER BY (received_ns, topic, partition, offset)
SETTINGS ttl_only_drop_parts = 1"""


# The stream job's checkpoints: which windows each consumer group has written, and its
# detectors' state, stored with every offset commit so a restart resumes exactly there.
CHECKPOINTS_DDL = """CREATE TABLE IF NOT EXISTS pipeline_checkpoints (
    `group` String,
    `written_ns` Int64,
    `state` String
)
ENGINE = ReplacingMergeTree(written_ns)
ORDER BY (`group`)"""

# Beside the checkpoints: the identity of each table when a checkpoint was written, so a
# checkpoint is not trusted over tables replaced since (trainscope/sinks/store_watch.py).
MARKS_DDL = """CREATE TABLE IF NOT EXISTS store_marks (
    `group` String,
    `written_ns` Int64,
    `marks` String
)
ENGINE = ReplacingMergeTree(written_ns)
ORDER BY (`group`)"""


# Calling-context trees of profiler traces: one row per rank, window and call path, with the
# whole path as arrays (root first), so one query gives the time of any path on any rank:
#   SELECT rank, sum(total_ns) FROM call_paths WHERE has(path, 'extra_work') AND
#   name = 'extra_work' GROUP BY rank
# ``total_ns`` includes what the path's events call; ``self_ns`` takes away their host-side
# children; ``steps`` is the number of profiler steps that started in the window. A live
# on-demand profile session is one "window": from the session's start to its stop.
CALL_PATHS_DDL = f"""CREATE TABLE IF NOT EXISTS call_paths (
    `job_id` LowCardinality(String),
    `rank` Int64,
    `window_start_ns` Int64 {TIME_CODEC},
    `window_end_ns` Int64 {TIME_CODEC},
    `callpath_id` UInt64,
    `parent_id` UInt64,
    `depth` Int64 {INT_CODEC},
    `layer` LowCardinality(String),
    `name` LowCardinality(String),
    `path` Array(LowCardinality(String)),
    `path_layers` Array(LowCardinality(String)),
    `count` Int64 {INT_CODEC},
    `total_ns` Int64 {INT_CODEC},
    `self_ns` Int64 {INT_CODEC},
    `steps` Int64 {INT_CODEC},
    `window_start` {datetime_of("window_start_ns")},
    `window_end` {datetime_of("window_end_ns")}
)
ENGINE = ReplacingMergeTree
PARTITION BY {day_of("window_start_ns")}
ORDER BY (job_id, rank, window_start_ns, callpath_id)
SETTINGS non_replicated_deduplication_window = 10000, ttl_only_drop_parts = 1"""

# Which tables a retention TTL applies to, and the ns column it measures age by.
TIME_COLUMNS: dict[str, str] = {
    **{t.name: t.time_column for t in TABLES.values() if t.time_column},
    "dead_letters": "received_ns",
    "call_paths": "window_start_ns",
}


def ttl_clause(table: str, retention_days: int) -> str:
    """``TTL …`` that drops a table's rows ``retention_days`` after their time (whole days
    at a time: with ``ttl_only_drop_parts`` ClickHouse drops expired day partitions instead
    of rewriting parts row by row)."""
    day = day_of(TIME_COLUMNS[table])
    return f"TTL {day} + INTERVAL {int(retention_days)} DAY"


def all_ddl() -> list[str]:
    return [table.ddl() for table in TABLES.values()] + [
        DEAD_LETTERS_DDL, CHECKPOINTS_DDL, CALL_PATHS_DDL,
    ]
