"""What trainscope's own profile costs a job is explained, not alerted; a fault alerted before
the profile, and a fault of another kind, stay alerts."""

from __future__ import annotations

import pandas as pd

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.explain import EXPLAINED_SCORE
from trainscope.detectors.own_cost import fold_own_cost, profile_busy_s
from trainscope.detectors.registry import DetectorRunner
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding
from trainscope.schemas.window import METRIC_COLUMNS, WindowView


def _finding(rank: int, category: str, detector: str = "peer-diff") -> Finding:
    return Finding(job_id="j", window_start_ns=0, window_end_ns=1, detector=detector, rank=rank,
                   category=category, score=0.9, message=f"{category} on rank {rank}")


def _alerted(findings: list[Finding]) -> set[tuple[int, str]]:
    return {(f.rank, f.category) for f in findings if f.score >= ALERT_THRESHOLD}


def test_new_alerts_that_look_like_a_profiles_cost_are_explained() -> None:
    findings = [_finding(2, "host", "waits"), _finding(2, "compute"),
                _finding(-1, "slowdown", "step-time"), _finding(1, "network", "mixture"),
                _finding(2, "gpu-throttle"), _finding(3, "compute")]
    folded = fold_own_cost(findings, {2: 1.5, 0: 0.2}, frozenset({(2, "host")}))
    # Rank 2's host time was alerted before its profile (what the profile was asked for): it
    # stays; a throttled GPU is no profile's doing; nor is compute on a rank not profiled.
    assert _alerted(folded) == {(2, "host"), (2, "gpu-throttle"), (3, "compute")}
    for f in (folded[1], folded[2], folded[3]):
        assert f.score == EXPLAINED_SCORE and f.evidence["explained_by_profile_s"] == 1.7
        assert ("[explained: trainscope's own profile of ranks 0, 2 was recording or being "
                "condensed for 1.5 s of this window") in f.message
    assert folded[1].evidence["explained_by_rank"] == 2
    # Without a profile in the window nothing changes.
    assert fold_own_cost(findings, {}, frozenset()) == findings


def _window(job: str, busy: dict[int, float]) -> WindowView:
    metrics = pd.DataFrame(
        [(rank, "h", -1, 1, m.PROFILER_BUSY_S, seconds) for rank, seconds in busy.items()]
        + [(rank, "h", 0, 1, m.SM_CLOCK_MHZ, 1400.0) for rank in range(4)],
        columns=list(METRIC_COLUMNS))
    return WindowView(job, 0, 10**9, metrics=metrics)


class Scripted:
    """Each window, the findings its script gives for it (the runner is under test)."""

    name = "scripted"

    def __init__(self, script: list[list[tuple[int, str]]]) -> None:
        self.script = script
        self.seen = 0

    def detect(self, window: WindowView) -> list[Finding]:
        found = self.script[self.seen]
        self.seen += 1
        return [window.finding(self.name, rank=rank, category=category, score=0.9,
                               message=f"{category} on rank {rank}")
                for rank, category in found]


def test_the_runner_explains_a_profiles_cost_from_the_windows_own_reports() -> None:
    # Reports cover the producer's rounds: what one rank reports is at most the window.
    assert profile_busy_s(_window("j", {2: 0.5, 1: 1.25})) == {1: 1.0, 2: 0.5}
    runner = DetectorRunner([Scripted([
        [(2, "host")],  # the fault, alerted: the closed loop profiles rank 2 and a peer
        [(2, "compute")],  # the profile starts; rank 2's host time held below the threshold
        [(2, "host"), (2, "compute"), (-1, "slowdown")],  # the profile is condensed
        [(2, "host"), (-1, "slowdown"), (0, "network")],  # still condensing
        [(2, "host"), (-1, "slowdown")],  # no profile: a slowdown now is the job's
    ])])
    alerts = [_alerted(runner.run(_window("j", busy)))
              for busy in ({}, {2: 0.5}, {2: 1.0, 0: 0.1}, {2: 1.0}, {})]
    assert alerts == [{(2, "host")}, set(), {(2, "host")}, {(2, "host")},
                      {(2, "host"), (-1, "slowdown")}]
    # Another job's windows know nothing of this job's profile.
    assert _alerted(runner.run(_window("k", {}))) == {(2, "host")}


def test_a_fault_alerted_before_a_long_profile_stays_an_alert_through_it() -> None:
    # Fault matrix case (c): the profile of a rank that shares its core with a busy neighbour
    # is condensed for five windows; the contention it was asked for, missing from the
    # detectors' answer meanwhile, is no cost of the profile when it shows again.
    runner = DetectorRunner([Scripted([
        [(2, "cpu-contention")],
        [], [(2, "compute")], [], [],  # the profile runs; the contention not seen
        [(2, "cpu-contention"), (0, "network")],  # still profiling: the fault is back
        [(2, "cpu-contention"), (0, "network")],  # the profile done
    ])])
    busy = [{}, {2: 1.0}, {2: 2.0}, {2: 2.0}, {2: 2.0}, {2: 1.5}, {}]
    alerts = [_alerted(runner.run(_window("j", b))) for b in busy]
    assert alerts == [{(2, "cpu-contention")}, set(), set(), set(), set(),
                      {(2, "cpu-contention")}, {(2, "cpu-contention"), (0, "network")}]
