"""Every built-in detector passes the shared detector contract."""

from __future__ import annotations

import dataclasses
import re

import pytest

from trainscope.detectors.contract import (
    ContractViolation,
    check_contract,
    contract_windows,
    example_windows,
)
from trainscope.detectors.mixture import MixtureDetector
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.registry import load
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.detectors.waits import WaitDetector
from trainscope.testing import check_detector, sample_windows


@pytest.fixture(scope="module")
def windows():
    return sample_windows()


@pytest.mark.parametrize("factory", [PeerDiffDetector, StepTimeDetector, RankAnomalyDetector])
def test_builtin_detectors_pass_the_contract(factory, windows) -> None:
    check_detector(factory, windows)


def test_the_contract_catches_a_detector_that_mutates_its_input(windows) -> None:
    class Mutating:
        name = "mutating"

        def detect(self, window):
            if not window.summaries.empty:
                window.summaries.loc[window.summaries.index[0], "count"] = -1
            return []

    with pytest.raises(AssertionError):
        check_detector(Mutating, [w for w in sample_windows(steps=20)])


@pytest.mark.parametrize(
    "factory", [PeerDiffDetector, StepTimeDetector, RankAnomalyDetector, MixtureDetector]
)
def test_builtin_detectors_pass_the_contract_on_the_registrys_synthetic_windows(factory) -> None:
    """The cheap windows the registry checks plugins on are valid input: every built-in passes."""
    check_contract(factory, contract_windows())


def test_the_synthetic_windows_give_a_detector_something_to_find() -> None:
    """The slow rank of the synthetic job is found, so determinism is checked on findings."""
    detector = PeerDiffDetector()
    found = [f for w in contract_windows() for f in detector.detect(w)]
    assert found and {(f.rank, f.function) for f in found} == {(5, "backward")}


def test_a_contract_violation_is_an_assertion_error_naming_the_promise() -> None:
    class NoName:
        name = ""

        def detect(self, window):
            return []

    with pytest.raises(ContractViolation, match="name must be a non-empty string") as caught:
        check_contract(NoName, contract_windows(count=1))
    assert isinstance(caught.value, AssertionError)


def _without_steps(windows, rank=None):
    """The windows with no step record (a stall: no step ended), or none of ``rank``'s."""
    return [dataclasses.replace(w, steps=w.steps.iloc[0:0] if rank is None
                                else w.steps[w.steps["rank"] != rank]) for w in windows]


@pytest.mark.parametrize("missing", ["every step", "rank 5's steps", "rank 1's steps"])
def test_every_builtin_keeps_its_evidence_finite_when_step_records_are_missing(missing) -> None:
    """A window in which no step ended (a stalled rank holds every peer in its all-reduce) or
    one rank sent none: per-step figures that cannot be known are left out, not NaN."""
    rank = None if missing == "every step" else int(missing.split()[1][0])
    windows = _without_steps(example_windows(4, slow_rank=5, stalled_rank=1), rank)
    for detector in load().detectors:
        check_contract(type(detector), windows)


def test_a_straggler_found_without_step_records_says_what_is_not_known() -> None:
    """The waits detector's own figure of time outside instrumented code needs step records: in
    a window without any, it is left out of the evidence and the message says so."""
    found = [f for w in _without_steps(contract_windows()) for f in WaitDetector().detect(w)]
    assert found and {f.rank for f in found} == {5}
    for f in found:
        assert "outside_instrumented_ns_per_step" not in f.evidence, f.evidence
        assert not re.search(r"\bnan\b", f.message), f.message
        assert "which explains it" in f.message or "is not known" in f.message, f.message
    assert any("is not known" in f.message for f in found)


def test_the_contract_catches_evidence_that_is_not_a_number() -> None:
    class Unknowing:
        name = "unknowing"

        def detect(self, window):
            if window.summaries.empty:
                return []
            return [window.finding(self.name, category="host", score=0.5, message="m",
                                   evidence={"step_ns": float("nan"), "z": 2.0})]

    with pytest.raises(ContractViolation, match="evidence step_ns not a finite number"):
        check_contract(Unknowing, contract_windows(count=2))
