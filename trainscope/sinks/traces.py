"""Writing condensed profiler traces to the store: function summaries, step records and the
calling-context tree (``call_paths``), straight from ``trainscope replay kineto --store``."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pandas as pd

from trainscope.schemas.records import SCHEMA_VERSION, StepRecord, SummaryBatch
from trainscope.sinks.clickhouse import ClickHouseSink

# The columns of call_paths in the order of trainscope.traces.cct.call_path_rows.
CALL_PATH_COLUMNS = (
    "job_id", "rank", "window_start_ns", "window_end_ns", "callpath_id", "parent_id", "depth",
    "layer", "name", "path", "path_layers", "count", "total_ns", "self_ns", "steps",
)


def write_summaries(sink: ClickHouseSink, batches: Sequence[SummaryBatch]) -> None:
    rows = [msgspec.structs.asdict(s) for b in batches for s in b.to_summaries()]
    if rows:
        sink._insert("function_summaries", pd.DataFrame(rows))


def write_steps(sink: ClickHouseSink, steps: Sequence[StepRecord]) -> None:
    if steps:
        frame = pd.DataFrame([msgspec.structs.asdict(s) for s in steps])
        sink._insert("step_records", frame.assign(v=SCHEMA_VERSION))


def write_call_paths(sink: ClickHouseSink, rows: Sequence[tuple[object, ...]]) -> None:
    if not rows:
        return
    try:
        sink.client.insert("call_paths", list(rows), column_names=list(CALL_PATH_COLUMNS))
    except Exception as exc:
        from trainscope.store import StoreError, _first_line

        raise StoreError(f"insert into call_paths failed: {_first_line(exc)}") from None
    sink.stats.rows_written += len(rows)
