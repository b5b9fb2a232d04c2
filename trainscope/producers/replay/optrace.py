"""Op traces (the what-if analysis input) on the bus.

The bus codec carries the streaming records; op traces use the what-if structs
(:mod:`trainscope.schemas.whatif`) in their own envelope on their own topic, one message per
rank and chunk, each carrying the job's parallel sizes so any message can be analysed alone.
The same envelope is what the live producer sends with ``attach(optrace=True)``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pandas as pd

from trainscope.schemas.optypes import OPTYPES
from trainscope.schemas.topics import OPTRACE_TOPIC
from trainscope.schemas.whatif import (
    OpTraceBatch,
    OpTraceJob,
    OpTraceRecord,
    decode_optrace,
    encode_records,
)

__all__ = ["OPTRACE_TOPIC", "OpTraceBatch", "decode_optrace", "encode_optrace", "read_optrace",
           "records_of", "to_frame"]

def read_optrace(trace: Path, meta: Path, job_id: str) -> tuple[OpTraceJob, pd.DataFrame]:
    """Load and validate a trace file and its metadata (raises ``TraceError``)."""
    from trainscope.schemas.optrace import load_trace, read_meta

    job_meta = read_meta(meta)
    frame = load_trace(trace, job_meta)
    return OpTraceJob(job_id=job_id, **job_meta.to_dict()), frame


def records_of(job: OpTraceJob, frame: pd.DataFrame) -> list[OpTraceRecord]:
    """Rows of a validated trace frame (``op`` codes) as records."""
    columns = {c: frame[c].tolist() for c in ("dp_rank", "stage", "rank", "step", "start_ts",
                                                "duration", "seq_id", "mc", "gmc", "mb_id")}
    ops = frame["op"].tolist()
    return [
        OpTraceRecord(
            job_id=job.job_id,
            dp_rank=columns["dp_rank"][i],
            stage=columns["stage"][i],
            rank=columns["rank"][i],
            step=columns["step"][i],
            optype=OPTYPES[ops[i]],
            start_ts=columns["start_ts"][i],
            duration=columns["duration"][i],
            seq_id=columns["seq_id"][i],
            mc=columns["mc"][i],
            gmc=columns["gmc"][i],
            mb_id=int(columns["mb_id"][i]),
        )
        for i in range(len(frame))
    ]


def encode_optrace(job: OpTraceJob, frame: pd.DataFrame) -> list[tuple[bytes, bytes]]:
    return encode_records(job, records_of(job, frame))


def to_frame(batches: list[OpTraceBatch]) -> pd.DataFrame:
    """Op-trace messages back into a trace table (the columns of a trace file)."""
    rows = [msgspec.structs.asdict(r) for b in batches for r in b.records]
    frame = pd.DataFrame(rows)
    return frame.drop(columns=["v", "job_id"], errors="ignore")
