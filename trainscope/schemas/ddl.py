"""ClickHouse tables, derived from the record structs so the two cannot drift apart.

Each table names the struct whose fields become its columns, the columns that are computed
or stored differently, and its engine keys. Every table is a ReplacingMergeTree with insert
deduplication on, so a batch delivered twice (at-least-once delivery) neither doubles rows at
insert time nor after a merge.
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
    MetricSample,
    ProfileCallPaths,
    SpanBatch,
    SpanEvent,
    StepRecord,
    SummaryBatch,
    Topology,
)

_SCALARS: dict[type, str] = {int: "Int64", float: "Float64", str: "String", bool: "Bool"}


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
    partition_by: str = ""

    @cached_property
    def insert_columns(self) -> tuple[str, ...]:
        """Columns a writer supplies: all but the ones ClickHouse computes itself."""
        return tuple(c for c, t in self.columns().items() if "MATERIALIZED" not in t)

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
        cols = ",\n    ".join(f"`{name}` {ctype}" for name, ctype in self.columns().items())
        partition = f"\nPARTITION BY {self.partition_by}" if self.partition_by else ""
        return (
            f"CREATE TABLE IF NOT EXISTS {self.name} (\n    {cols}\n)\n"
            f"ENGINE = ReplacingMergeTree{partition}\n"
            f"ORDER BY ({', '.join(self.order_by)})\n"
            # Block-level insert deduplication for non-replicated tables: a re-sent batch
            # (same rows, same order) is dropped at insert time.
            "SETTINGS non_replicated_deduplication_window = 10000"
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


TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            name="function_summaries",
            struct=FunctionSummary,
            order_by=("job_id", "window_start_ns", "rank", "layer", "name", "callpath_id"),
            types={"callpath_id": "UInt64", "sketch_counts": "Array(UInt64)"},
            extra={"mean_ns": "Float64 MATERIALIZED if(count = 0, 0, total_ns / count)"},
        ),
        Table(
            name="step_records",
            struct=StepRecord,
            order_by=("job_id", "rank", "step"),
        ),
        Table(
            name="metric_samples",
            struct=MetricSample,
            order_by=("job_id", "name", "rank", "device", "ts_ns"),
        ),
        Table(
            name="findings",
            struct=Finding,
            order_by=("job_id", "window_start_ns", "detector", "rank", "pp_stage", "function"),
        ),
        # The call path that explains a finding, from the stream job's automatic profile of the
        # suspect and a peer (trainscope pipeline --auto-profile). A table beside findings,
        # not columns of it: a finding is written with its window; its profile arrives later.
        Table(
            name="finding_call_paths",
            struct=FindingCallPath,
            order_by=("job_id", "window_start_ns", "detector", "rank", "category"),
            types={"callpath_id": "UInt64"},
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
    SpanEvent, SpanBatch, SummaryBatch, ControlMessage, ProfileCallPaths,
)

DEAD_LETTERS_DDL = """CREATE TABLE IF NOT EXISTS dead_letters (
    `received_ns` Int64,
    `topic` String,
    `partition` Int64,
    `offset` Int64,
    `error` String,
    `payload` String
)
ENGINE = MergeTree
ORDER BY (received_ns, topic, partition, offset)"""


# The stream job's checkpoints: which windows each consumer group has written, and its
# detectors' state, stored with every offset commit so a restart resumes exactly there.
CHECKPOINTS_DDL = """CREATE TABLE IF NOT EXISTS pipeline_checkpoints (
    `group` String,
    `written_ns` Int64,
    `state` String
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
CALL_PATHS_DDL = """CREATE TABLE IF NOT EXISTS call_paths (
    `job_id` String,
    `rank` Int64,
    `window_start_ns` Int64,
    `window_end_ns` Int64,
    `callpath_id` UInt64,
    `parent_id` UInt64,
    `depth` Int64,
    `layer` String,
    `name` String,
    `path` Array(String),
    `path_layers` Array(String),
    `count` Int64,
    `total_ns` Int64,
    `self_ns` Int64,
    `steps` Int64
)
ENGINE = ReplacingMergeTree
ORDER BY (job_id, rank, window_start_ns, callpath_id)
SETTINGS non_replicated_deduplication_window = 10000"""


def all_ddl() -> list[str]:
    return [table.ddl() for table in TABLES.values()] + [
        DEAD_LETTERS_DDL, CHECKPOINTS_DDL, CALL_PATHS_DDL,
    ]
