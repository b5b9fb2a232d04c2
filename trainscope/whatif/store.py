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
from trainscope.schemas.whatif import SCHEMA_VERSION, SETUP_SQL, TRACE_COLUMNS, stored_trace_rows
from trainscope.whatif.analysis import WhatIf

# Rows per insert: big enough to amortise the per-insert cost, small enough to bound memory.
INSERT_CHUNK_ROWS = 2_000_000


def connect(
    store_dir: str | Path | None = None,
    url: str | None = None,
    *,
    create: bool = True,
    settings: Settings | None = None,
    read_only: bool = False,
) -> Any:
    """A clickhouse-connect client with the what-if tables created.

    Without ``create`` the store directory must already exist (reading a job from a mistyped
    path must not leave an empty store behind). ``read_only``: a client that only reads (an
    embedded store another process owns is read through its read endpoint); the tables are
    left as they are.
    """
    from trainscope.store.client import connect as connect_store

    if (store_dir is None) == (url is None):
        raise ValueError("give exactly one of a store directory or a ClickHouse URL")
    client = connect_store(store_dir, url, create=create, readonly=read_only, settings=settings)
    if not read_only:
        for sql in SETUP_SQL:
            client.command(sql)
    return client


def write_trace(client: Any, job_id: str, frame: pd.DataFrame, meta: JobMeta) -> int:
    """Store a validated trace (see :func:`optrace.validate`) and its metadata; returns rows."""
    out = stored_trace_rows(job_id, frame)
    for lo in range(0, len(out), INSERT_CHUNK_ROWS):
        client.insert_df("op_traces", out.iloc[lo : lo + INSERT_CHUNK_ROWS])
    job = {"v": SCHEMA_VERSION, "job_id": job_id, **meta.to_dict()}
    client.insert("op_trace_jobs", [list(job.values())], column_names=list(job))
    return len(out)


def read_trace(client: Any, job_id: str) -> tuple[pd.DataFrame, JobMeta]:
    """The raw trace of a job (columns as in a trace file) and its metadata."""
    made = client.query("SELECT count() FROM system.tables WHERE database = currentDatabase() "
                        "AND name IN ('op_traces', 'op_trace_jobs')")
    if made.result_rows[0][0] < 2:  # no op trace ever stored (a read-only client made none)
        raise TraceError(_no_trace(job_id))
    jobs = client.query(
        "SELECT dp_size, pp_size, tp_size, dsp_size, vpp_size, world_size "
        "FROM op_trace_jobs FINAL WHERE job_id = {job:String}",
        parameters={"job": job_id},
    )
    if not jobs.result_rows:
        raise TraceError(_no_trace(job_id))
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


def _no_trace(job_id: str) -> str:
    return (f"job {job_id!r}: no op trace in the store (a job sends one with "
            "attach(optrace=True) or TRAINSCOPE_OPTRACE=1 to a `trainscope pipeline` that writes "
            "this store; a trace file is imported with --trace FILE --meta FILE --job JOB)")


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

