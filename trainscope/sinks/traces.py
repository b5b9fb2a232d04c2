"""Writing condensed profiler traces to the store: function summaries, step records and the
calling-context tree (``call_paths``), straight from ``trainscope replay kineto --store``."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pandas as pd

from trainscope.schemas.records import SCHEMA_VERSION, StepRecord, SummaryBatch
from trainscope.sinks.clickhouse import (
    ClickHouseSink,
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
    sink.write_call_path_rows(rows)
