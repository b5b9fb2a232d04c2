"""Findings of several detectors about one suspect make one diagnosis entry."""

from __future__ import annotations

import pytest

from trainscope.detectors.diagnosis import diagnose
from trainscope.schemas.records import Finding

WINDOW_NS = 15 * 10**9


def finding(detector: str, window: int, score: float, function: str = "", **fields) -> Finding:
    return Finding(
        job_id="j", window_start_ns=window * WINDOW_NS, window_end_ns=(window + 1) * WINDOW_NS,
        detector=detector, rank=13, ranks=[13], category="gpu-compute", score=score,
        layer="torch_op" if function else "", function=function,
        message=f"{detector} says rank 13 in window {window}", **fields,
    )


def test_windows_are_counted_once_however_many_detectors_report_them() -> None:
    findings = [finding("peer-diff", w, 0.6, "backward") for w in range(3)]
    findings += [finding("mixture", w, 1.0) for w in range(3)]
    findings += [finding("multivariate", 1, 0.8)]
    (suspect,) = diagnose(findings)
    assert suspect.windows == 3
    assert suspect.detectors == {"peer-diff", "mixture", "multivariate"}
    # Each window weighs its strongest score once.
    assert suspect.score == 1.0 and suspect.weight == 3.0


def test_the_function_comes_from_a_detector_that_names_it_even_when_weaker() -> None:
    findings = [
        finding("mixture", 0, 1.0, evidence={"strength": 40.0}),
        finding("peer-diff", 0, 0.7, "backward", evidence={"z": 12.0}),
        finding("mixture", 1, 1.0, evidence={"strength": 41.0}),
    ]
    (suspect,) = diagnose(findings)
    assert (suspect.layer, suspect.function) == ("torch_op", "backward")
    assert suspect.message == "peer-diff says rank 13 in window 0"
    assert suspect.evidence == {"z": 12.0}
    assert suspect.as_json()["function"] == "backward"


def test_without_a_function_the_strongest_latest_finding_describes_the_suspect() -> None:
    findings = [finding("mixture", 0, 0.9), finding("multivariate", 1, 0.9),
                finding("mixture", 2, 0.6)]
    (suspect,) = diagnose(findings)
    assert suspect.function == "" and suspect.message == "multivariate says rank 13 in window 1"
    assert suspect.score == pytest.approx(0.8)


def test_a_suspect_below_the_threshold_is_not_an_alert() -> None:
    assert diagnose([finding("peer-diff", w, 0.4, "backward") for w in range(5)]) == []
