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


def _slow_gpu_windows(seed: int) -> list:
    """The windows of a simulated 32-rank job with a slow GPU, through the embedded engine."""
    from trainscope.engine.embedded_job import EmbeddedStreamJob
    from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults

    views: list = []
    job = EmbeddedStreamJob([], window_s=15.0, on_window=lambda view, _: views.append(view))
    cluster = SimulatedCluster(ClusterSpec(dp=4, pp=2, tp=4, steps=90, seed=seed, window_s=15.0),
                               parse_faults(["slow-gpu:rank=9,factor=1.5,start=40"]))
    job.process_records(cluster.topology_records())
    for output in cluster.run():
        job.process_records([*output.summaries, *output.steps, *output.metrics])
    job.finish()
    return views


def test_scores_for_all_ranks_at_once_are_rivers_one_by_one() -> None:
    """hst_batch.score_many on river's model gives river's score_one, bit for bit: features
    of a real simulated job's windows (a slow GPU), with a feature the trees never saw and one
    they know missing from a window, and values outside what the scaler learned."""
    from trainscope.detectors.hst_batch import score_many
    from trainscope.detectors.multivariate import RankAnomalyDetector

    views = _slow_gpu_windows(seed=7)
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


def _state(model) -> tuple:
    """Everything river's model learns: the scaler's limits, the trees' masses, the count
    towards the next pivot."""
    scaler, hst = model.steps.values()
    limits = {name: (scaler.min[name].get(), scaler.max[name].get()) for name in scaler.min}
    masses = [[(node.l_mass, node.r_mass) for node in tree.iter_dfs()] for tree in hst.trees]
    return limits, masses, hst.counter, hst._first_window


def test_learning_all_ranks_at_once_leaves_rivers_state_one_by_one() -> None:
    """hst_batch.learn_many leaves river's model as learn_one row by row does, bit for bit:
    from a model with no trees yet, over windows of a real simulated job's features whose rows
    cross the pivot every 32 rows (mid-batch, at uneven points), with values beyond the
    scaler's limits, a feature the trees never saw, and ones they split on missing. The scores
    of the next window agree too."""
    import copy

    from trainscope.detectors.hst_batch import learn_many
    from trainscope.detectors.multivariate import RankAnomalyDetector

    views = _slow_gpu_windows(seed=11)
    detector = RankAnomalyDetector(window_size=32)
    frames = [detector.features(view) for view in views]
    frames = [f for f in frames if not f.empty]
    assert len(frames) >= 4 and all(len(f) == 32 for f in frames)
    batches = [frames[0].iloc[:21], frames[0].iloc[21:], frames[1], frames[2] * 3.0 - 1.0,
               frames[3].assign(new=0.5).iloc[5:], frames[3].drop(columns=["step_ns"]),
               frames[1].iloc[:40:3],
               # Features the trees split on missing across pivots: every row takes the child
               # learned most, by the masses since the last pivot.
               pd.concat([frames[0], frames[2] * 0.5]).drop(columns=["step_ns"]),
               frames[1].drop(columns=list(frames[1].columns[1::2]))]
    by_batch, by_row = detector._new_model(), detector._new_model()
    pivots = 0
    for batch in batches:
        first_window = by_row.steps["HalfSpaceTrees"]._first_window
        learn_many(by_batch, batch)
        for row in batch.to_dict(orient="records"):
            by_row.learn_one(row)
        assert _state(by_batch) == _state(by_row)
        pivots += first_window and not by_row.steps["HalfSpaceTrees"]._first_window
        probe = copy.deepcopy(by_batch)
        assert [probe.score_one(r) for r in frames[-1].to_dict(orient="records")] == [
            by_row.score_one(r) for r in frames[-1].to_dict(orient="records")]
    assert pivots == 1 and sum(len(b) for b in batches) > 7 * 32
    # An empty frame learns nothing.
    before = _state(by_batch)
    learn_many(by_batch, frames[0].iloc[:0])
    assert _state(by_batch) == before
