"""``check_detector``: the contract every detector — built-in or plugin — must satisfy.

It runs a small simulated job through the embedded pipeline, so it sits above producers, the
stream engine and the detectors rather than among the detectors. It is one of the two modules at
the top of the package (with ``__init__``) because ``trainscope.testing`` is the import path the
docs give plugin authors, the one place outside ``cli/`` where composition is public API.

Run it in a plugin's own test suite::

    from trainscope.testing import check_detector
    check_detector(MyDetector)
"""

from __future__ import annotations

from collections.abc import Callable

from trainscope.detectors.base import Detector
from trainscope.detectors.contract import check_contract
from trainscope.schemas.window import WindowView


def sample_windows(steps: int = 60, seed: int = 5) -> list[WindowView]:
    """Closed windows of a small simulated job with a slow GPU, for contract checks."""
    from trainscope.engine.embedded_job import EmbeddedStreamJob
    from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults

    views: list[WindowView] = []
    pipeline = EmbeddedStreamJob([], window_s=5.0, on_window=lambda v, f: views.append(v))
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
    can be deep-copied (one copy per job), does not mutate its input, handles an empty window.

    The checks are :func:`trainscope.detectors.contract.check_contract` (which the registry also
    runs on a plugin as it loads it, on small synthetic windows); here they run on windows of a
    simulated job through the real pipeline unless ``windows`` are given.
    """
    check_contract(factory, windows if windows is not None else sample_windows())
