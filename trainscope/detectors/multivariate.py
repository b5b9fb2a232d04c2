"""Per-rank multivariate anomaly scoring with river's Half-Space Trees.

Each window, every rank becomes one vector: step time, shares of compute / collective /
data-loader / GC time, and its hardware metrics (SM clock, utilisation, power, NIC and PCIe
throughput). Why Half-Space Trees: it scores a point by how little *mass* sits around it, so a
rank that stands apart is found whichever features moved, without a threshold per metric; it
learns online in constant time and memory per point (the job drifts, the model follows) and is
picklable for checkpoints. Features are min-max scaled first because HST assumes [0, 1] inputs.

HST scores are not calibrated probabilities, so a rank is reported only when its score stands
out from the other ranks' in the same window (robust z) and the feature that deviates most is
named — with the category that feature points to.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainscope.detectors.features import (
    OWN_WORK_CATEGORY,
    WAIT_LAYERS,
    gpu_evidence,
    honest_category,
    metric_means,
    per_step_times,
    robust_z,
    step_time_ns,
    throttling_shares,
)
from trainscope.detectors.hst_batch import learn_many, score_many
from trainscope.detectors.params import check_number
from trainscope.detectors.throttle import ThrottleRule
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

# Feature → the category a deviation of that feature points to (None: symptom only).
FEATURES: dict[str, str | None] = {
    "step_ns": None,
    "compute_share": "gpu-compute",
    "collective_share": None,
    "dataloader_share": "dataloader",
    "gc_share": "python-gc",
    m.SM_CLOCK_MHZ: "gpu-throttle",
    m.SM_UTIL_PCT: "gpu-compute",
    m.POWER_W: "gpu-throttle",
    m.NIC_TX_BYTES_PER_S: "network",
    m.PCIE_TX_BYTES_PER_S: "pcie",
}

# The smallest move of a time share (a fraction of the rank's step) that can name a cause.
# Some shares are zero on most ranks in a window: routine GC pauses hit a third of the ranks in
# a 15 s window, so the peers' median and MAD of ``gc_share`` are 0. Measured against a zero
# scale, one routine 10 ms pause is millions of sigmas, and it took the blame whenever a rank
# that stood apart for another reason (a slow GPU) happened to have one. A share is judged
# against at least this absolute spread instead.
SHARE_SCALE_FLOOR = 0.01
# Other features (times, metrics) are judged against at least this tiny absolute spread and
# robust_z's relative floor.
FEATURE_SCALE_FLOOR = 1e-9
DETECTOR = "multivariate"
# Fewer ranks than this give no median of scores worth standing apart from.
MIN_RANKS = 4
# The most ranks the trees learn from per window (all of them in jobs up to this size).
LEARN_MAX_RANKS = 1024
# HST scores of a window's ranks are compared with at least this absolute spread: ranks that all
# score alike must not turn a 0.01 difference into an outlier.
SCORE_SCALE_FLOOR = 0.02
# The score's confidence factor reaches 1 at this robust z of the anomaly score.
FULL_Z = 20.0


class RankAnomalyDetector:
    """Finds a rank that stands apart from the others on several features at once, with river's
    Half-Space Trees (the module docstring says why this model).

    Each window, every rank becomes one vector (step time, time shares, hardware metrics); the
    trees score every vector, then learn from them. A rank whose score stands ``z_min`` robust z
    above the other ranks' in the window is reported with the feature that moved most and the
    category it points to; a rank whose most deviant feature is only a symptom (step time,
    collective share, or an SM clock or power draw the throttle rule does not confirm) is not.

    State, kept across windows and pickled with checkpoints: the scaler and the trees (built on
    the first window, never in the constructor) and the number of windows seen.

    Parameters
    ----------
    n_trees : int, default 25 (trees)
        Trees in the Half-Space Trees ensemble (river's default is 10): more trees steady the
        score, at a proportional cost per rank and window.
    height : int, default 8 (levels)
        Height of each tree: how finely the feature space is cut around a vector.
    window_size : int, default 256 (rank vectors)
        Vectors per reference window of the trees, which score against the mass of the
        previous reference window and score 0 until the first is full: 256 is several windows
        of a mid-size job.
    z_min : float, default 8.0 (robust z)
        A rank whose anomaly score stands this far above the other ranks' in the window is
        reported: HST scores are not calibrated, so only a clear outlier counts.
    grace_windows : int, default 2 (windows)
        Windows that only train the trees: their first scores are meaningless.
    seed : int, default 42 (no unit)
        Seed of the trees' random splits, so findings are reproducible.

    Examples
    --------
    A job of 2 stages × 8 ranks whose rank 2 waits 150 ms per step for its data loader; small
    trees whose reference window (32 vectors) fills in two windows of the 16 ranks:

    >>> from trainscope.detectors.contract import example_windows
    >>> detector = RankAnomalyDetector(height=4, window_size=32)
    >>> for window in example_windows(4, dp=8, stalled_rank=2):
    ...     for finding in detector.detect(window):
    ...         print(finding.category, finding.rank, finding.message.rsplit("; ", 1)[-1])
    dataloader 2 most deviant: dataloader_share
    dataloader 2 most deviant: dataloader_share
    """

    name = DETECTOR

    def __init__(
        self,
        n_trees: int = 25,
        height: int = 8,
        window_size: int = 256,
        z_min: float = 8.0,
        grace_windows: int = 2,
        seed: int = 42,
    ) -> None:
        check_number(DETECTOR, "n_trees", n_trees, ge=1, integer=True)
        check_number(DETECTOR, "height", height, ge=1, integer=True)
        check_number(DETECTOR, "window_size", window_size, ge=1, integer=True)
        check_number(DETECTOR, "z_min", z_min, gt=0)
        check_number(DETECTOR, "grace_windows", grace_windows, ge=0, integer=True)
        check_number(DETECTOR, "seed", seed, ge=0, integer=True)
        self.n_trees = n_trees
        self.height = height
        self.window_size = window_size
        self.z_min = z_min
        self.grace_windows = grace_windows
        self.seed = seed
        self._model = None
        self._seen = 0
        # Whether this job ever showed GPU evidence: without it, compute is not gpu-compute.
        self._gpu_seen = False

    def _new_model(self):
        from river import anomaly, compose, preprocessing

        return compose.Pipeline(
            preprocessing.MinMaxScaler(),
            anomaly.HalfSpaceTrees(
                n_trees=self.n_trees,
                height=self.height,
                window_size=self.window_size,
                seed=self.seed,
            ),
        )

    def features(self, window: WindowView) -> pd.DataFrame:
        table = per_step_times(window)
        if table.empty:
            return pd.DataFrame()
        total = table.sum(axis=1).replace(0, np.nan)
        layer = table.columns.get_level_values(0)
        own = [OWN_WORK_CATEGORY.get(x) for x in layer]
        frame = pd.DataFrame(index=table.index)
        frame["step_ns"] = step_time_ns(window)
        def share(mask: list[bool]) -> pd.Series:
            return table.loc[:, mask].sum(axis=1) / total

        frame["compute_share"] = share([c == "gpu-compute" for c in own])
        frame["collective_share"] = share([x in WAIT_LAYERS for x in layer])
        frame["dataloader_share"] = share([c == "dataloader" for c in own])
        frame["gc_share"] = share([c == "python-gc" for c in own])
        means = metric_means(window)
        for metric in FEATURES:
            if metric in means.columns:
                frame[metric] = means[metric].reindex(frame.index)
        return frame.fillna(0.0)

    def detect(self, window: WindowView) -> list[Finding]:
        frame = self.features(window)
        if frame.empty:
            return []
        if self._model is None:
            self._model = self._new_model()
        # Scored for all ranks at once, on river's model (hst_batch: the same scores).
        scores = pd.Series(score_many(self._model, frame), index=frame.index)
        # Learned all at once, in rank order, as learn_one would (hst_batch: the same state).
        learned = _learned_ranks(list(frame.index), self.seed + self._seen)
        learn_many(self._model, frame.loc[learned])
        self._seen += 1
        # getattr: a checkpoint from before the flag existed restores without it.
        self._gpu_seen = getattr(self, "_gpu_seen", False) or gpu_evidence(window)
        if self._seen <= self.grace_windows or len(frame) < MIN_RANKS:
            return []
        z, reference = robust_z(scores, None, floor=SCORE_SCALE_FLOOR, rel_floor=0.0)
        findings = []
        for rank in scores.index[(z >= self.z_min).to_numpy()]:
            feature, feature_z = _most_deviant(frame, rank)
            category = FEATURES.get(feature)
            if category == "gpu-throttle" and not ThrottleRule().judge(
                throttling_shares(window), metric_means(window), int(rank)
            )[0]:
                # A clock below the peers' that the throttle rule does not confirm is the
                # straggler working while its peers wait (trainscope/detectors/throttle.py):
                # a symptom, like the step time.
                category = None
            if category is None:
                continue
            category = honest_category(category, self._gpu_seen)
            score = round(float(min(1.0, scores[rank])) * min(1.0, float(z[rank]) / FULL_Z), 4)
            findings.append(
                window.finding(
                    self.name,
                    rank=int(rank),
                    ranks=[int(rank)],
                    category=category,
                    score=score,
                    evidence={
                        "anomaly_score": float(scores[rank]),
                        "peer_median_score": float(reference[rank]),
                        "z": float(z[rank]),
                        f"feature:{feature}": float(frame.loc[rank, feature]),
                        "feature_z": feature_z,
                    },
                    message=(
                        f"{category}: rank {rank} stands apart from its peers (anomaly score "
                        f"{scores[rank]:.2f} vs {reference[rank]:.2f}); most deviant: {feature}"
                    ),
                )
            )
        return findings


def _most_deviant(frame: pd.DataFrame, rank: int) -> tuple[str, float]:
    best, best_z = "", 0.0
    for column in frame.columns:
        floor = SHARE_SCALE_FLOOR if column.endswith("_share") else FEATURE_SCALE_FLOOR
        z, _ = robust_z(frame[column], None, floor=floor)
        value = abs(float(z[rank])) if np.isfinite(z[rank]) else 0.0
        if value > best_z:
            best, best_z = column, value
    return best, best_z


def _learned_ranks(ranks: list, seed: int) -> list:
    """The ranks the trees learn from in one window: all of them up to ``LEARN_MAX_RANKS``,
    else that many drawn at random (seeded: reproducible), in their order. The trees' reference
    is their last ``window_size`` vectors: thousands more per window only roll it over again,
    at a cost that grows with the job (0.2 s per window at 10,240 ranks)."""
    if len(ranks) <= LEARN_MAX_RANKS:
        return ranks
    chosen = np.random.default_rng(seed).choice(len(ranks), LEARN_MAX_RANKS, replace=False)
    return [ranks[i] for i in np.sort(chosen)]
