"""Which call path the dashboard shows beside each finding, read from a real chDB store.

The closed loop profiles a rank on the first alert that names it and not again for a while, so
the same rank's later findings of another category - another detector's view of the same
straggler - have no call path of their own: they show the rank's newest one and say which
finding it was asked for. A rank never profiled, and a job-level finding, show none.
"""

from __future__ import annotations

from pathlib import Path

from trainscope.schemas.records import Finding, FindingCallPath
from trainscope.sinks.clickhouse import ClickHouseSink
from trainscope.store.client import connect
from trainscope.ui.queries import DashboardQueries

JOB = "paths-job"
S = 10**9


def finding(rank: int, category: str, detector: str, start_s: int) -> Finding:
    return Finding(job_id=JOB, window_start_ns=start_s * S, window_end_ns=(start_s + 2) * S,
                   detector=detector, rank=rank, category=category, score=0.9,
                   message=f"{category}: rank {rank}")


def call_path(rank: int, category: str, detector: str, to_s: int, block: str) -> FindingCallPath:
    return FindingCallPath(
        job_id=JOB, window_start_ns=0, window_end_ns=2 * S, detector=detector, rank=rank,
        category=category, score=0.9, peer_rank=1, request_id=f"r-{rank}-{to_s}",
        profiled_from_ns=(to_s - 1) * S, profiled_to_ns=to_s * S, steps=5, per_step=True,
        path=["train.py(10)", block], path_layers=["python", "python"],
        path_delta_ns=[3.0e7, 3.0e7], suspect_ns=3.2e7, peer_ns=2.0e6, delta_ns=3.0e7,
        message=f"rank {rank} spends +30 ms/step in {block}")


def test_a_ranks_other_findings_show_its_newest_call_path_and_what_it_was_asked_for(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    sink = ClickHouseSink.open(str(store))
    sink.write_findings([
        finding(2, "cpu-contention", "peer-diff", 10),  # the first alert: rank 2 profiled
        finding(2, "host", "waits", 14),  # the same straggler, said by another detector
        finding(3, "gpu-compute", "peer-diff", 10),  # its own profile, an older one of 2
        finding(5, "network", "peer-diff", 12),  # never profiled
        finding(-1, "cpu-contention", "waits", 12),  # job-level: no rank to profile
    ])
    sink.write_finding_call_paths([
        call_path(2, "cpu-contention", "peer-diff", 13, "preprocess"),
        call_path(3, "gpu-compute", "peer-diff", 20, "forward"),
        call_path(3, "straggler", "early", 12, "stale"),
    ])
    sink.close()

    queries = DashboardQueries(connect(store, None, readonly=True, create=False),
                               threshold=0.5)
    shown = {(f["rank"], f["category"]): f["call_path"] for f in queries.findings(JOB)}

    assert set(shown) == {(2, "cpu-contention"), (2, "host"), (3, "gpu-compute"),
                          (5, "network"), (-1, "cpu-contention")}
    for category in ("cpu-contention", "host"):
        path = shown[(2, category)]
        assert path is not None and path["path"][-1] == "preprocess", (category, path)
        assert path["profiled_for"] == "cpu-contention"
    own = shown[(3, "gpu-compute")]
    assert own is not None and (own["path"][-1], own["profiled_for"]) == ("forward",
                                                                         "gpu-compute")
    assert shown[(5, "network")] is None
    assert shown[(-1, "cpu-contention")] is None
