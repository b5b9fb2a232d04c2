"""A declared rank that never reported is ``no-data`` (a deployment problem), not ``hang``.

Real-shaped windows: a simulated 16-rank job (dp 4 × pp 2 × tp 2) through the embedded stream
job. Its topology declares all 16 ranks; to play producers that never started, or a rank that
stops mid-run, that rank's rows are removed from the windows after the engine built them.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

WORLD = 16


@cache
def healthy_windows() -> tuple[WindowView, ...]:
    spec = ClusterSpec(steps=60, seed=5, dp=4, pp=2, tp=2, metric_interval_s=1.0)
    views: list[WindowView] = []
    job = EmbeddedStreamJob([], window_s=15.0, on_window=lambda v, f: views.append(v))
    for records in SimulatedCluster(spec, []).batches():
        job.process_records(records)
    job.finish()
    assert views and views[0].topology is not None
    assert len(views[0].topology.workers) == WORLD
    return tuple(views)


def without(view: WindowView, ranks: set[int]) -> WindowView:
    """The window as if ``ranks`` had sent nothing in it."""
    return dataclasses.replace(
        view,
        summaries=view.summaries[~view.summaries["rank"].isin(ranks)],
        steps=view.steps[~view.steps["rank"].isin(ranks)],
        metrics=view.metrics[~view.metrics["rank"].isin(ranks)],
    )


def run(views: list[WindowView]) -> list[Finding]:
    detector = StepTimeDetector()
    return [f for v in views for f in detector.detect(v)]


def test_healthy_job_has_neither_hang_nor_no_data() -> None:
    found = run(list(healthy_windows()))
    assert not [f for f in found if f.category in ("hang", "no-data")], found


def test_half_the_declared_ranks_never_reporting_is_no_data_not_hang() -> None:
    silent = set(range(8, WORLD))
    views = [without(v, silent) for v in healthy_windows()]
    found = run(views)
    assert not [f for f in found if f.category == "hang"], found
    no_data = [f for f in found if f.category == "no-data"]
    # Every window says so, each naming all eight ranks.
    assert len(no_data) == len(views) >= 3, found
    assert all(f.ranks == sorted(silent) and f.rank == 8 for f in no_data), no_data
    assert "never reported" in no_data[-1].message and "attach()" in no_data[-1].message
    # Below the alert threshold in the first window (a late start is no fault), an alert
    # from the second on, never above it (it explains no slowdown).
    assert no_data[0].score < ALERT_THRESHOLD
    assert all(f.score == ALERT_THRESHOLD for f in no_data[1:]), no_data


def test_a_rank_that_stops_mid_run_is_a_hang() -> None:
    views = list(healthy_windows())
    stop = 2
    found = run(views[:stop] + [without(v, {3}) for v in views[stop:]])
    assert not [f for f in found if f.category == "no-data"], found
    hangs = [f for f in found if f.category == "hang"]
    assert hangs and all(f.ranks == [3] and f.score == 1.0 for f in hangs), found
    assert {f.window_start_ns for f in hangs} >= {views[stop].window_start_ns}, hangs
