"""``check_detector``: the contract every detector — built-in or plugin — must satisfy.

It runs a small simulated job through the embedded pipeline, so it sits above producers, the
stream engine and the detectors rather than among the detectors.

Run it in a plugin's own test suite::

    from trainscope.testing import check_detector
    check_detector(MyDetector)
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pandas as pd

from trainscope.detectors.base import Detector
from trainscope.schemas.window import WindowView


def sample_windows(steps: int = 60, seed: int = 5) -> list[WindowView]:
    """Closed windows of a small simulated job with a slow GPU, for contract checks."""
    from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
    from trainscope.streams.pipeline import EmbeddedPipeline

    views: list[WindowView] = []
    pipeline = EmbeddedPipeline([], window_s=5.0, on_window=lambda v, f: views.append(v))
    cluster = SimulatedCluster(ClusterSpec(dp=4, pp=2, tp=1, steps=steps, seed=seed,
                                           window_s=5.0),
                               parse_faults(["slow-gpu:rank=1,factor=1.5"]))
    for records in cluster.batches():
        pipeline.process_records(records)
    pipeline.finish()
    return views


def check_detector(
    factory: Callable[[], Detector], windows: list[WindowView] | None = None
) -> None:
    """Raise AssertionError naming the broken promise: a detector pickles, is deterministic,
    can be deep-copied (one copy per job), does not mutate its input, handles an empty window."""
    windows = windows if windows is not None else sample_windows()
    detector = factory()
    assert isinstance(detector, Detector), "must have a `name` and a `detect(window)` method"
    assert isinstance(detector.name, str) and detector.name, "name must be a non-empty string"

    assert detector.detect(WindowView("job", 0, 10**9)) == [], "an empty window gives no finding"

    frozen = [(w.summaries.copy(), w.steps.copy(), w.metrics.copy()) for w in windows]
    first = [detector.detect(w) for w in windows]
    for w, (s, st, m) in zip(windows, frozen, strict=True):
        for before, after in ((s, w.summaries), (st, w.steps), (m, w.metrics)):
            pd.testing.assert_frame_equal(before, after, obj="window frame (detect mutated it)")

    twin = factory()
    twin.detect(WindowView("job", 0, 10**9))
    second = [twin.detect(w) for w in windows]
    assert first == second, "deterministic: two fresh instances gave different findings"

    # The runner gives every job a deep copy of one instance: a copy must start fresh too.
    clone = copy.deepcopy(factory())
    assert [clone.detect(w) for w in windows] == first, "a deep copy must act like a new one"

    half = len(windows) // 2
    original = factory()
    for w in windows[:half]:
        original.detect(w)
    restored = pickle.loads(pickle.dumps(original))
    tail = [original.detect(w) for w in windows[half:]]
    assert tail == [restored.detect(w) for w in windows[half:]], (
        "a pickled and restored detector must continue exactly like the original"
    )
    for findings in first:
        for f in findings:
            assert 0.0 <= f.score <= 1.0, f"score {f.score} outside [0, 1]"
            assert f.job_id, "findings carry the window's job"
