"""Detector settings are checked when a detector is built, with a one-line error naming the
detector, the argument, the valid range and the value given."""

from __future__ import annotations

import pickle

import pytest

from trainscope.detectors.mixture import MixtureDetector
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.params import DetectorConfigError
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.schemas.errors import TrainscopeError


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (PeerDiffDetector, {"z_min": -1}, "peer-diff: z_min must be > 0, got -1"),
        (PeerDiffDetector, {"z_min": 12.0, "z_full": 6.0},
         "peer-diff: z_min must be < z_full, got 12.0 and 6.0"),
        (PeerDiffDetector, {"confirm_windows": 0},
         "peer-diff: confirm_windows must be >= 1, got 0"),
        (PeerDiffDetector, {"confirm_windows": 1.5},
         "peer-diff: confirm_windows must be an integer, got 1.5"),
        (PeerDiffDetector, {"history_windows": 2},
         "peer-diff: history_windows must be >= 3, got 2"),
        (PeerDiffDetector, {"throughput_drop_frac": 1.0},
         "peer-diff: throughput_drop_frac must be > 0 and < 1, got 1.0"),
        (PeerDiffDetector, {"clock_ratio_max": float("nan")},
         "peer-diff: clock_ratio_max must be a number, got nan"),
        (PeerDiffDetector, {"throttled_excess_frac": "0.25"},
         "peer-diff: throttled_excess_frac must be a number, got '0.25'"),
        (PeerDiffDetector, {"min_excess_ns": True},
         "peer-diff: min_excess_ns must be a number, got True"),
        (StepTimeDetector, {"slowdown_frac": 0}, "step-time: slowdown_frac must be > 0, got 0"),
        (StepTimeDetector, {"slowdown_frac": 0.3},
         "step-time: slowdown_frac must be < full_slowdown_frac, got 0.3 and 0.2"),
        (StepTimeDetector, {"min_slowdown_ns": -5},
         "step-time: min_slowdown_ns must be >= 0, got -5"),
        (MixtureDetector, {"tail_quantile": 1.5},
         "mixture: tail_quantile must be > 0 and < 1, got 1.5"),
        (MixtureDetector, {"min_train_vectors": 4},
         "mixture: min_train_vectors must be >= 10, got 4"),
        (MixtureDetector, {"history_vectors": 16},
         "mixture: history_vectors must be >= 32, got 16"),
        (RankAnomalyDetector, {"n_trees": 0}, "multivariate: n_trees must be >= 1, got 0"),
        (RankAnomalyDetector, {"z_min": -8.0}, "multivariate: z_min must be > 0, got -8.0"),
    ],
)
def test_a_bad_setting_fails_at_construction_in_one_line(factory, kwargs, message) -> None:
    with pytest.raises(DetectorConfigError) as caught:
        factory(**kwargs)
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, TrainscopeError)


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (PeerDiffDetector, {"z_min": 3.0, "z_full": 4.0, "confirm_windows": 1,
                            "history_windows": 3, "min_excess_ns": 0}),
        (StepTimeDetector, {"slowdown_frac": 0.05, "full_slowdown_frac": 0.5}),
        (MixtureDetector, {"min_train_vectors": 10, "history_vectors": 10, "grace_windows": 0}),
        (RankAnomalyDetector, {"n_trees": 1, "height": 1, "grace_windows": 0, "seed": 0}),
    ],
)
def test_settings_at_the_edge_of_their_range_are_accepted(factory, kwargs) -> None:
    detector = factory(**kwargs)
    assert all(getattr(detector, k) == v for k, v in kwargs.items())


def test_a_checkpoint_from_before_a_setting_existed_restores_with_its_default() -> None:
    old = PeerDiffDetector(z_min=7.0)
    for added in ("peers_capped_frac", "power_limit_ratio_max"):
        del old.__dict__[added]
    restored = pickle.loads(pickle.dumps(old))
    fresh = PeerDiffDetector()
    assert restored.peers_capped_frac == fresh.peers_capped_frac
    assert restored.power_limit_ratio_max == fresh.power_limit_ratio_max
    assert restored.z_min == 7.0  # what was checkpointed wins over the defaults
