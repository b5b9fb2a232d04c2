"""Records of the straggler what-if analysis, and their ClickHouse tables.

- :class:`OpTraceRecord`: one op of a Megatron-style op trace (the analysis input). Field names
  follow the Megatron timer export (``start_ts``/``duration`` in float seconds) so traces load
  unchanged; ``mb_id`` is -1 for ops that carry no micro-batch (everything but compute).
- :class:`OpTraceJob`: the job's parallel sizes, needed to analyse its trace.
- :class:`WhatIfResultRecord`: one analysis of one job.

``DDL`` holds the CREATE TABLE statements; a test checks that their columns are exactly the
struct fields. The tables are ReplacingMergeTree so re-inserting a trace or a result does not
double it.
"""

from __future__ import annotations

import msgspec
import pandas as pd

from trainscope.schemas.optypes import OPTYPES
from trainscope.schemas.topics import rank_key

SCHEMA_VERSION = 1


class OpTraceRecord(msgspec.Struct, kw_only=True, frozen=True):
    v: int = SCHEMA_VERSION
    job_id: str
    dp_rank: int
    stage: int
    rank: int
    step: int
    optype: str
    start_ts: float
    duration: float
    seq_id: int
    mc: int = 0
    gmc: int = 0
    mb_id: int = -1


class OpTraceJob(msgspec.Struct, kw_only=True, frozen=True):
    v: int = SCHEMA_VERSION
    job_id: str
    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int


class WhatIfResultRecord(msgspec.Struct, kw_only=True, frozen=True):
    v: int = SCHEMA_VERSION
    job_id: str
    analysed_at_ns: int
    S: float
    M_W: float  # NaN when the job has no slowdown to explain
    M_S: float
    sim_error_median: float
    sim_error_p90: float
    steps: int
    steps_dropped: int
    workers: int
    step_time_real_s: float
    step_time_nodelay_s: float
    step_time_ideal_s: float
    S_per_step: dict[str, float]  # step number (as text) → S of that step
    S_optype: dict[str, float]
    S_dp_rank: dict[str, float]
    S_stage: dict[str, float]
    S_worker_json: str  # JSON list of {dp_rank, stage, score}, most suspect first
    warnings: list[str] = []
    fit: int = 0  # 0: the trace fits the what-if model; else bits of whatif.fit.FIT_*


DDL: dict[str, str] = {
    "op_traces": """CREATE TABLE IF NOT EXISTS op_traces (
    `v` UInt16,
    `job_id` String,
    `dp_rank` Int32,
    `stage` Int32,
    `rank` Int64,
    `step` Int64,
    `optype` LowCardinality(String),
    `start_ts` Float64,
    `duration` Float64,
    `seq_id` Int32,
    `mc` Int32,
    `gmc` Int32,
    `mb_id` Int32
)
ENGINE = ReplacingMergeTree
ORDER BY (job_id, step, stage, dp_rank, optype, seq_id)""",
    "op_trace_jobs": """CREATE TABLE IF NOT EXISTS op_trace_jobs (
    `v` UInt16,
    `job_id` String,
    `dp_size` Int32,
    `pp_size` Int32,
    `tp_size` Int32,
    `dsp_size` Int32,
    `vpp_size` Int32,
    `world_size` Int32
)
ENGINE = ReplacingMergeTree
ORDER BY (job_id)""",
    "whatif_results": """CREATE TABLE IF NOT EXISTS whatif_results (
    `v` UInt16,
    `job_id` String,
    `analysed_at_ns` Int64,
    `S` Float64,
    `M_W` Float64,
    `M_S` Float64,
    `sim_error_median` Float64,
    `sim_error_p90` Float64,
    `steps` Int64,
    `steps_dropped` Int64,
    `workers` Int64,
    `step_time_real_s` Float64,
    `step_time_nodelay_s` Float64,
    `step_time_ideal_s` Float64,
    `S_per_step` Map(String, Float64),
    `S_optype` Map(String, Float64),
    `S_dp_rank` Map(String, Float64),
    `S_stage` Map(String, Float64),
    `S_worker_json` String,
    `warnings` Array(String),
    `fit` UInt8
)
ENGINE = ReplacingMergeTree
ORDER BY (job_id, analysed_at_ns)""",
}

# What makes a store ready for the what-if tables: each table, and the columns added since
# (stores created before the model-fit flag existed get it, 0 = fits).
SETUP_SQL: tuple[str, ...] = (
    *DDL.values(),
    "ALTER TABLE whatif_results ADD COLUMN IF NOT EXISTS `fit` UInt8",
)

# Which struct each table stores (one column per field, same order).
TABLE_STRUCTS: dict[str, type[msgspec.Struct]] = {
    "op_traces": OpTraceRecord,
    "op_trace_jobs": OpTraceJob,
    "whatif_results": WhatIfResultRecord,
}

# The columns of op_traces after its version and job id, in order.
TRACE_COLUMNS: tuple[str, ...] = tuple(
    name for name in OpTraceRecord.__struct_fields__ if name not in ("v", "job_id"))


def stored_trace_rows(job_id: str, frame: pd.DataFrame) -> pd.DataFrame:
    """A validated trace (:func:`trainscope.schemas.optrace.validate`: op types as the codes
    of column ``op``) as rows of ``op_traces``."""
    return pd.DataFrame(
        {
            "v": SCHEMA_VERSION,
            "job_id": job_id,
            **{c: frame[c].to_numpy() for c in TRACE_COLUMNS if c != "optype"},
            "optype": pd.Categorical.from_codes(frame["op"].to_numpy(), list(OPTYPES)).astype(str),
        }
    )[["v", "job_id", *TRACE_COLUMNS]]


# -- on the bus -------------------------------------------------------------------------------
# Op traces travel on OPTRACE_TOPIC in this envelope, one message per rank and chunk, each
# carrying the job's sizes so any message can be analysed alone; the live producer and
# ``trainscope replay optrace`` both send it.
CHUNK_OPS = 5_000


class OpTraceBatch(msgspec.Struct, tag="optrace", kw_only=True, frozen=True):
    job: OpTraceJob
    records: list[OpTraceRecord]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(OpTraceBatch)


def encode_records(job: OpTraceJob, records: list[OpTraceRecord]) -> list[tuple[bytes, bytes]]:
    """(key, payload) messages: per rank, in chunks."""
    by_rank: dict[int, list[OpTraceRecord]] = {}
    for record in records:
        by_rank.setdefault(record.rank, []).append(record)
    out = []
    for rank, items in sorted(by_rank.items()):
        for lo in range(0, len(items), CHUNK_OPS):
            batch = OpTraceBatch(job=job, records=items[lo : lo + CHUNK_OPS])
            out.append((rank_key(job.job_id, rank), _encoder.encode(batch)))
    return out


def decode_optrace(payload: bytes) -> OpTraceBatch:
    return _decoder.decode(payload)
