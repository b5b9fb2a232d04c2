"""Which feature the multivariate detector blames for a rank that stands apart."""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainscope.detectors.multivariate import FEATURES, _most_deviant

RANKS = 16
SUSPECT = 5


def features(compute_share: float, gc_share: float) -> pd.DataFrame:
    """A window's features: peers alike (a little jitter), the suspect's compute and GC set.
    Routine GC pauses hit a few ranks per window, so most ranks' gc_share is exactly 0."""
    rng = np.random.default_rng(3)
    frame = pd.DataFrame({
        "compute_share": 0.50 + rng.normal(0, 0.005, RANKS),
        "collective_share": 0.40 + rng.normal(0, 0.005, RANKS),
        "gc_share": 0.0,
        "sm_util_pct": 55 + rng.normal(0, 0.5, RANKS),
    }, index=pd.Index(range(RANKS), name="rank"))
    frame.loc[2, "gc_share"] = 0.0015  # a routine 20 ms pause on a healthy rank
    frame.loc[SUSPECT, ["compute_share", "gc_share"]] = [compute_share, gc_share]
    return frame


def test_a_slow_rank_with_one_routine_gc_pause_is_not_blamed_on_gc() -> None:
    feature, z = _most_deviant(features(compute_share=0.65, gc_share=0.0012), SUSPECT)
    assert (feature, FEATURES[feature]) == ("compute_share", "gpu-compute")
    assert z > 10


def test_a_real_gc_pause_is_blamed_on_gc() -> None:
    # 300 ms every 5 steps of ~1.1 s: about 5% of the rank's step.
    feature, z = _most_deviant(features(compute_share=0.48, gc_share=0.05), SUSPECT)
    assert (feature, FEATURES[feature]) == ("gc_share", "python-gc")
    assert z >= 3


def test_scores_for_all_ranks_at_once_are_rivers_one_by_one() -> None:
    """hst_batch.score_many on river's model gives river's score_one, bit for bit: features
    of a real simulated job's windows (a slow GPU), with a feature the trees never saw and one
    they know missing from a window, and values outside what the scaler learned."""
    from trainscope.detectors.hst_batch import score_many
    from trainscope.detectors.multivariate import RankAnomalyDetector
    from trainscope.engine.embedded_job import EmbeddedStreamJob
    from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults

    views = []
    job = EmbeddedStreamJob([], window_s=15.0, on_window=lambda view, _: views.append(view))
    cluster = SimulatedCluster(ClusterSpec(dp=4, pp=2, tp=4, steps=90, seed=7, window_s=15.0),
                               parse_faults(["slow-gpu:rank=9,factor=1.5,start=40"]))
    job.process_records(cluster.topology_records())
    for output in cluster.run():
        job.process_records([*output.summaries, *output.steps, *output.metrics])
    job.finish()
    detector = RankAnomalyDetector(window_size=32)
    compared = 0
    for view in views:
        frame = detector.features(view)
        model = detector._model
        if model is not None:
            for variant in (frame, frame.drop(columns=[frame.columns[-1]]).assign(new=0.5),
                            frame * 3.0 - 1.0):
                expected = [model.score_one(row) for row in
                            variant.to_dict(orient="index").values()]
                assert score_many(model, variant).tolist() == expected
                compared += len(variant)
        detector.detect(view)
    assert compared >= 3 * 32 * (len(views) - 1) > 0
