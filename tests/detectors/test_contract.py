"""Every built-in detector passes the shared detector contract."""

from __future__ import annotations

import pytest

from trainscope.detectors.contract import ContractViolation, check_contract, contract_windows
from trainscope.detectors.mixture import MixtureDetector
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.steptime import StepTimeDetector
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
