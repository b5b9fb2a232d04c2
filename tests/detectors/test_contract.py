"""Every built-in detector passes the shared detector contract."""

from __future__ import annotations

import pytest

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
