"""Jobs sharing one pipeline: each job's findings are exactly those it gets alone."""

from __future__ import annotations

import logging
from itertools import zip_longest

import pytest

from trainscope.detectors.mixture import MixtureDetector
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.records import Finding

FAULTS = [
    "slow-gpu:rank=5,factor=1.4",
    "gc-pause:rank=3,ms=300,every=5",
    "dataloader-stall:rank=6,ms=150",
    "throttle:rank=2,mhz=1300",
    "slow-link:rank=1,factor=3",
    "slow-gpu:rank=0,factor=1.6",
    "gc-pause:rank=7,ms=200,every=3",
    "stage-imbalance:stage=1,factor=1.3",
    "dataloader-stall:rank=4,ms=300",
    "throttle:rank=6,mhz=1100",
]
WINDOW_S = 5.0


def detectors() -> list:
    return [PeerDiffDetector(), StepTimeDetector(), RankAnomalyDetector(), MixtureDetector()]


def cluster(job: int, steps: int) -> SimulatedCluster:
    spec = ClusterSpec(job_id=f"job-{job}", dp=4, pp=2, tp=1, steps=steps, seed=20 + job,
                       window_s=WINDOW_S)
    return SimulatedCluster(spec, parse_faults([FAULTS[job]]))


def keys(findings: list[Finding]) -> set[tuple[int, str, str, int]]:
    return {(f.rank, f.category, f.function, f.window_start_ns) for f in findings}


def findings_alone(job: int, steps: int) -> list[Finding]:
    pipeline = EmbeddedStreamJob(detectors(), window_s=WINDOW_S)
    for records in cluster(job, steps).batches():
        pipeline.process_records(records)
    pipeline.finish()
    return pipeline.findings


def findings_together(jobs: int, steps: int, **kwargs: int) -> tuple[EmbeddedStreamJob,
                                                                   dict[str, list[Finding]]]:
    """Every step of every job goes in one call, so records of all jobs interleave."""
    pipeline = EmbeddedStreamJob(detectors(), window_s=WINDOW_S, **kwargs)
    streams = [cluster(job, steps).batches() for job in range(jobs)]
    for step in zip_longest(*streams, fillvalue=[]):
        pipeline.process_records([r for records in step for r in records])
    pipeline.finish()
    by_job: dict[str, list[Finding]] = {f"job-{job}": [] for job in range(jobs)}
    for f in pipeline.findings:
        by_job[f.job_id].append(f)
    return pipeline, by_job


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [2, 10])
def test_each_job_finds_what_it_finds_alone(jobs: int) -> None:
    steps = 90 if jobs == 2 else 50
    _, together = findings_together(jobs, steps)
    for job in range(jobs):
        alone = findings_alone(job, steps)
        assert any(f.score >= 0.5 for f in alone), f"job {job} alone raised no alert"
        mixed = together[f"job-{job}"]
        assert keys(mixed) == keys(alone), f"job {job} ({FAULTS[job]})"
        # Stronger still: scores and evidence too, since no state crossed between jobs.
        order = sorted(alone, key=repr)
        assert sorted(mixed, key=repr) == order


def test_the_least_recently_seen_job_is_evicted_counted_and_logged(caplog) -> None:
    pipeline = EmbeddedStreamJob(detectors(), window_s=WINDOW_S, max_jobs=2)
    with caplog.at_level(logging.WARNING, logger="trainscope.engine.core"):
        for job in range(3):  # one job after the other: the third pushes the first out
            for records in cluster(job, 40).batches():
                pipeline.process_records(records)
    stats = pipeline.stats()
    assert stats.jobs_evicted == 1
    assert pipeline.runner.jobs() == ["job-1", "job-2"]
    assert "job job-0 evicted: more than 2 jobs" in caplog.text
    # Nothing is lost silently: the evicted job's open windows were closed and detected, so
    # it has exactly the findings of a run that ended normally.
    evicted = [f for f in pipeline.findings if f.job_id == "job-0"]
    assert keys(evicted) == keys(findings_alone(0, 40))
