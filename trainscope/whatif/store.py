"""Op traces and what-if results in ClickHouse (an embedded chDB directory or a server URL).

chDB lets one process open a single store directory, and no other process may open it at the
same time; open the store once per process and reuse the client.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pandas as pd

from trainscope.config.settings import Settings
from trainscope.schemas.optrace import JobMeta, TraceError
from trainscope.schemas.optypes import OPTYPES
from trainscope.schemas.whatif import DDL, SCHEMA_VERSION, TABLE_STRUCTS
from trainscope.whatif.analysis import WhatIf

# Rows per insert: big enough to amortise the per-insert cost, small enough to bound memory.
INSERT_CHUNK_ROWS = 2_000_000
TRACE_COLUMNS = [
    name for name in TABLE_STRUCTS["op_traces"].__struct_fields__ if name not in ("v", "job_id")
]


def connect(
    store_dir: str | Path | None = None,
    url: str | None = None,
    *,
    create: bool = True,
    settings: Settings | None = None,
) -> Any:
    """A clickhouse-connect client with the what-if tables created.

    Without ``create`` the store directory must already exist (reading a job from a mistyped
    path must not leave an empty store behind).
    """
    from trainscope.store.client import connect as connect_store

    if (store_dir is None) == (url is None):
        raise ValueError("give exactly one of a store directory or a ClickHouse URL")
    client = connect_store(store_dir, url, create=create, settings=settings)
    for ddl in DDL.values():
        client.command(ddl)
    # Stores created before the model-fit flag existed get the column (0 = fits).
    client.command("ALTER TABLE whatif_results ADD COLUMN IF NOT EXISTS `fit` UInt8")
    return client


def write_trace(client: Any, job_id: str, frame: pd.DataFrame, meta: JobMeta) -> int:
    """Store a validated trace (see :func:`optrace.validate`) and its metadata; returns rows."""
    out = pd.DataFrame(
        {
            "v": SCHEMA_VERSION,
            "job_id": job_id,
            **{c: frame[c].to_numpy() for c in TRACE_COLUMNS if c != "optype"},
            "optype": pd.Categorical.from_codes(frame["op"].to_numpy(), list(OPTYPES)).astype(str),
        }
    )[["v", "job_id", *TRACE_COLUMNS]]
    for lo in range(0, len(out), INSERT_CHUNK_ROWS):
        client.insert_df("op_traces", out.iloc[lo : lo + INSERT_CHUNK_ROWS])
    job = {"v": SCHEMA_VERSION, "job_id": job_id, **meta.to_dict()}
    client.insert("op_trace_jobs", [list(job.values())], column_names=list(job))
    return len(out)


def read_trace(client: Any, job_id: str) -> tuple[pd.DataFrame, JobMeta]:
    """The raw trace of a job (columns as in a trace file) and its metadata."""
    jobs = client.query(
        "SELECT dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size "
        "FROM op_trace_jobs FINAL WHERE job_id = {job:String}",
        parameters={"job": job_id},
    )
    if not jobs.result_rows:
        raise TraceError(f"job {job_id!r}: no op trace in the store")
    meta = JobMeta.from_mapping(
        dict(zip(jobs.column_names, jobs.result_rows[-1], strict=True)), f"job {job_id!r} metadata"
    )
    columns = ", ".join(f"`{c}`" for c in TRACE_COLUMNS)
    frame = client.query_arrow(
        f"SELECT {columns} FROM op_traces FINAL WHERE job_id = {{job:String}}",
        parameters={"job": job_id},
    ).to_pandas()
    if frame.empty:
        raise TraceError(f"job {job_id!r}: the store has its metadata but no op rows")
    return frame, meta


def write_result(
    client: Any, job_id: str, result: WhatIf, analysed_at_ns: int | None = None
) -> int:
    analysed_at_ns = analysed_at_ns if analysed_at_ns is not None else time.time_ns()
    d = result.to_dict()
    row = {
        "v": SCHEMA_VERSION,
        "job_id": job_id,
        "analysed_at_ns": analysed_at_ns,
        "S": result.S,
        "M_W": result.M_W,
        "M_S": result.M_S,
        "sim_error_median": result.sim_error_median,
        "sim_error_p90": result.sim_error_p90,
        "steps": result.steps,
        "steps_dropped": len(result.steps_dropped),
        "workers": result.workers,
        "step_time_real_s": result.step_time_real_s,
        "step_time_nodelay_s": result.step_time_nodelay_s,
        "step_time_ideal_s": result.step_time_ideal_s,
        "S_per_step": {str(k): float(v) for k, v in result.S_per_step.items()},
        "S_optype": {k: float(v) for k, v in result.S_optype.items()},
        "S_dp_rank": {str(k): float(v) for k, v in result.S_dp_rank.items()},
        "S_stage": {str(k): float(v) for k, v in result.S_stage.items()},
        "S_worker_json": json.dumps(d["S_worker"]),
        "warnings": list(result.warnings),
        "fit": result.fit,
    }
    client.insert("whatif_results", [list(row.values())], column_names=list(row))
    return analysed_at_ns


def read_results(client: Any, job_id: str) -> list[dict[str, Any]]:
    result = client.query(
        "SELECT * FROM whatif_results FINAL WHERE job_id = {job:String} ORDER BY analysed_at_ns",
        parameters={"job": job_id},
    )
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]

