"""The job page's what-if section, before any what-if ran, says how to fill it for that job and
store: the command that analyses the op trace the job sent, or how a job sends one. Read from a
real chDB store through ``trainscope ui`` as its own process."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pandas as pd
from dashboard_procs import get, serve

from trainscope.schemas.optrace import JobMeta, validate
from trainscope.schemas.records import Finding
from trainscope.schemas.whatif import OpTraceJob
from trainscope.sinks.clickhouse import ClickHouseSink

S = 10**9


def _finding(job_id: str) -> Finding:
    return Finding(job_id=job_id, window_start_ns=10 * S, window_end_ns=12 * S,
                   detector="peer-diff", rank=1, category="compute", score=0.9,
                   message="compute: rank 1")


def _hint(url: str, job_id: str) -> str:
    status, body = get(f"{url}/api/job/overview?id={urllib.parse.quote(job_id)}")
    assert status == 200, body[:500]
    overview = json.loads(body)
    assert overview["whatif"] is None
    return overview["whatif_hint"]


def test_the_what_if_section_says_how_to_fill_it_for_this_job_and_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    sink = ClickHouseSink.open(str(store))
    sink.write_findings([_finding("traced job"), _finding("plain")])
    ops = pd.DataFrame({"dp_rank": [0, 1], "stage": [0, 0], "rank": [0, 1], "step": [3, 3],
                        "optype": ["forward-compute"] * 2, "start_ts": [1.0, 1.0],
                        "duration": [0.1, 0.2], "seq_id": [0, 0]})
    meta = JobMeta(dp_size=2, pp_size=1, world_size=2)
    sink.write_op_trace(OpTraceJob(job_id="traced job", dp_size=2, pp_size=1, world_size=2),
                        validate(ops, meta, "test"))
    sink.close()

    with serve(store, tmp_path / "ui.log") as url:
        traced, plain = _hint(url, "traced job"), _hint(url, "plain")
    assert traced == (f"the job's op trace is in the store (2 ops): trainscope whatif "
                      f"--job 'traced job' --store {store}")
    assert plain.startswith("the job sent no op trace (attach(optrace=True) or "
                            "TRAINSCOPE_OPTRACE=1 sends one to the pipeline); from a trace file: ")
    assert plain.endswith(f"--meta META.yaml --job plain --store {store}")
