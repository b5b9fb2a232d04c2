"""A Gaussian-mixture detector over several metrics of a rank at once (in the eACGM spirit).

Each window, every rank becomes one vector: its step time, SM clock, utilisation, power,
temperature, PCIe/NIC/NVLink throughput, and the shares of its time in collectives, off CPU,
in the data loader and in GC — whichever the window holds. Each value is taken *relative to the
rank's peers in the same window* (the median of its pipeline stage, or of the job), so a job
that slows down as a whole, or a new phase of training, does not look anomalous, and one
model serves every rank of the job.

A Gaussian mixture (scikit-learn, number of components chosen by BIC) is fitted on healthy
vectors and refitted as the job runs. What is healthy is decided before it can poison the
model: vectors that the current model flags, or that sit far from their peers on any feature
(a loose robust-z gate, needed when a fault is present from the first window), never enter the
training set. A rank is flagged when its log-likelihood falls well below the low tail of the
training vectors' log-likelihoods; the finding names the features that moved most (in standard
deviations of the mixture component that explains the vector best) and maps them to a
category, e.g. an SM clock drop to ``gpu-throttle``.

Why a mixture rather than a threshold per metric: healthy ranks of one job differ in correlated
ways (utilisation and power move together; stages spend different shares in collectives), and
a mixture models those joint modes, so a combination that no healthy rank shows stands out
while each metric alone may look ordinary.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pandas as pd

from trainscope.detectors.features import (
    MAD_TO_SIGMA,
    WAIT_LAYERS,
    group_medians,
    metric_means,
    per_step_times,
    robust_z_matrix,
    throttling_shares,
)
from trainscope.detectors.params import check_number
from trainscope.detectors.throttle import PeerMedians, ThrottleRule
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

# Feature → {direction of the move: category it points to}. Features without an entry for a
# direction are symptoms (a straggler's step time) rather than causes.
CATEGORY_OF_MOVE: dict[str, dict[int, str]] = {
    m.SM_CLOCK_MHZ: {-1: "gpu-throttle"},
    m.POWER_W: {-1: "gpu-throttle"},
    # A hotter GPU is also a busier one: temperature is evidence, not a cause on its own.
    m.TEMPERATURE_C: {},
    m.SM_UTIL_PCT: {-1: "gpu-compute", +1: "gpu-compute"},
    m.PCIE_TX_BYTES_PER_S: {-1: "pcie"},
    m.PCIE_RX_BYTES_PER_S: {-1: "pcie"},
    m.NIC_TX_BYTES_PER_S: {-1: "network"},
    m.NIC_RX_BYTES_PER_S: {-1: "network"},
    m.NVLINK_TX_BYTES_PER_S: {-1: "nvlink"},
    m.NVLINK_RX_BYTES_PER_S: {-1: "nvlink"},
    "step_ns": {},
    "collective_share": {+1: "network"},
    "off_cpu_share": {+1: "cpu-contention"},
    "dataloader_share": {+1: "dataloader"},
    "gc_share": {+1: "python-gc"},
}
# Most specific causes first: which move names the category when several features moved.
CATEGORY_PRIORITY: list[tuple[str, int]] = [
    (m.SM_CLOCK_MHZ, -1),
    (m.NIC_TX_BYTES_PER_S, -1),
    (m.NIC_RX_BYTES_PER_S, -1),
    (m.PCIE_TX_BYTES_PER_S, -1),
    (m.PCIE_RX_BYTES_PER_S, -1),
    (m.NVLINK_TX_BYTES_PER_S, -1),
    (m.NVLINK_RX_BYTES_PER_S, -1),
    ("off_cpu_share", +1),
    ("dataloader_share", +1),
    ("gc_share", +1),
    (m.POWER_W, -1),
    (m.SM_UTIL_PCT, -1),
    (m.SM_UTIL_PCT, +1),
    ("collective_share", +1),
]
METRIC_FEATURES = tuple(k for k in CATEGORY_OF_MOVE if not k.endswith(("_share", "_ns")))
# A model per set of features present; a job whose windows alternate between a few sets (with
# and without NIC metrics, say) keeps them all, a bounded number of them.
MAX_FEATURE_SETS = 8
DETECTOR = "mixture"
# Fewer ranks than this give no peer median worth comparing with.
MIN_RANKS = 4
# A stage is its ranks' peer group when every stage has at least this many ranks (a median of
# fewer is one rank's value); otherwise the whole job is.
MIN_STAGE_PEERS = 3
# A feature whose z under the best component reaches this moved: only such moves name a
# category.
MOVED_Z = 3.0
# A mixture of k components is fitted only on at least this many training vectors per
# component (a rule of thumb against fitting noise with a diagonal Gaussian of a dozen
# features).
VECTORS_PER_COMPONENT = 10
# The spread of healthy log-likelihoods is never taken below 1 nat: a model whose training
# vectors score nearly alike would otherwise flag a tiny drop as many spreads.
MIN_LL_SCALE = 1.0
# A finding names this many of the features that moved most (evidence and message).
FEATURES_NAMED = 3
# Relative deviations divide by the peers' median, never by less than this (a zero median).
MEDIAN_FLOOR = 1e-9
SHARE_LAYERS = {
    "collective_share": (tuple(WAIT_LAYERS), None),
    "off_cpu_share": ("sched", "off_cpu"),
    "dataloader_share": ("dataloader", None),
    "gc_share": ("gc", None),
}


class MixtureDetector:
    """Finds a rank whose metrics, taken together, no healthy rank shows: a Gaussian mixture
    over each rank's deviations from its peers (the module docstring says why a mixture).

    Each window, every rank becomes one vector of its metrics relative to the median of its
    peers; after ``grace_windows`` windows and ``min_train_vectors`` healthy vectors, a rank
    whose log-likelihood under the mixture falls ``min_strength`` robust spreads below the low
    tail of the training vectors' is reported, naming the features that moved most and the
    category the most specific of them points to. State, kept across windows and pickled with
    checkpoints, per set of features present (a window without NIC metrics is another model,
    at most 8 sets): the last ``history_vectors`` healthy vectors, the fitted mixture with its
    threshold, and the typical number of samples behind each feature. The constructor learns
    nothing.

    Parameters
    ----------
    max_components : int, default 3 (components)
        Most Gaussian components of the mixture; the number is chosen by BIC. Healthy ranks of
        a job fall into a few modes (pipeline stages, first and last stage), rarely more.
    min_train_vectors : int, default 32 (rank vectors)
        Healthy vectors needed before the first fit: fewer cannot fit even one diagonal
        component of a dozen features reliably. At least 10.
    grace_windows : int, default 2 (windows)
        Windows that only train the model: the first windows of a job are warm-up.
    history_vectors : int, default 2048 (rank vectors)
        Healthy vectors kept for refitting, a sliding window: it bounds memory and the cost of
        a refit, and lets the model follow the job. At least ``min_train_vectors``.
    healthy_gate_z : float, default 6.0 (robust z)
        A vector further than this from its peers on any feature (robust z over the window's
        ranks) never trains the model: the loose gate against a fault that is there from the
        first window.
    gate_floor : float, default 0.02 (fraction of the peers' value, or of the step for shares)
        The smallest spread that gate uses.
    tail_quantile : float, default 0.01 (quantile)
        The low tail of the training vectors' log-likelihoods that anomalies are measured
        from: 1%, so the threshold itself is a rare healthy vector.
    min_strength : float, default 8.0 (robust spreads of the log-likelihood)
        A finding needs a log-likelihood this many robust spreads (never under 1 nat) below that
        tail; its score is 0.5 there, the alert threshold, and 0.75 at twice that.
    variance_floor : float, default 4e-4 (squared fraction of the peers' median)
        Added to each variance of the mixture: a 2% standard deviation of deviations that are
        fractions of the peers' median, below which differences are noise.
    seed : int, default 0 (no unit)
        Seed of the mixture's initialisation, so findings are reproducible.

    Examples
    --------
    A job of 2 stages × 8 ranks whose rank 2 waits 150 ms per step for its data loader: the
    model is fitted on the healthy ranks of the first three windows, and the fourth flags
    rank 2.

    >>> from trainscope.detectors.contract import example_windows
    >>> detector = MixtureDetector()
    >>> for window in example_windows(4, dp=8, stalled_rank=2):
    ...     for finding in detector.detect(window):
    ...         print(finding.category, finding.rank, finding.score)
    ...         print(finding.message.split("moved most: ")[1].split("; ")[1])
    dataloader 2 1.0
    dataloader_share 0.2441 vs peers 0.01026
    """

    name = DETECTOR

    def __init__(
        self,
        max_components: int = 3,
        min_train_vectors: int = 32,
        grace_windows: int = 2,
        history_vectors: int = 2048,
        healthy_gate_z: float = 6.0,
        gate_floor: float = 0.02,
        tail_quantile: float = 0.01,
        min_strength: float = 8.0,
        variance_floor: float = 4e-4,
        seed: int = 0,
    ) -> None:
        check_number(DETECTOR, "max_components", max_components, ge=1, integer=True)
        check_number(DETECTOR, "min_train_vectors", min_train_vectors,
                     ge=VECTORS_PER_COMPONENT, integer=True)
        check_number(DETECTOR, "grace_windows", grace_windows, ge=0, integer=True)
        check_number(DETECTOR, "history_vectors", history_vectors, ge=min_train_vectors,
                     integer=True)
        check_number(DETECTOR, "healthy_gate_z", healthy_gate_z, gt=0)
        check_number(DETECTOR, "gate_floor", gate_floor, ge=0)
        check_number(DETECTOR, "tail_quantile", tail_quantile, gt=0, lt=1)
        check_number(DETECTOR, "min_strength", min_strength, gt=0)
        check_number(DETECTOR, "variance_floor", variance_floor, gt=0)
        check_number(DETECTOR, "seed", seed, ge=0, integer=True)
        self.max_components = max_components
        self.min_train_vectors = min_train_vectors
        self.grace_windows = grace_windows
        self.history_vectors = history_vectors
        self.healthy_gate_z = healthy_gate_z
        self.gate_floor = gate_floor
        self.tail_quantile = tail_quantile
        self.min_strength = min_strength
        self.variance_floor = variance_floor
        self.seed = seed
        # Learned state, per feature set (a window without NIC metrics is another model).
        self._history: dict[tuple[str, ...], deque[np.ndarray]] = {}
        self._models: dict[tuple[str, ...], dict[str, Any]] = {}
        self._typical_counts: dict[tuple[str, ...], np.ndarray] = {}
        self._windows = 0

    # -- features -----------------------------------------------------------------------------
    def features(self, window: WindowView) -> pd.DataFrame:
        """Raw per-rank features of a window (index rank), before peer normalisation."""
        frame = pd.DataFrame()
        means = metric_means(window)
        for metric in METRIC_FEATURES:
            if metric in means.columns:
                frame[metric] = means[metric]
        steps = window.steps
        if not steps.empty:
            frame = frame.reindex(frame.index.union(steps["rank"].unique()))
            frame["step_ns"] = steps.groupby("rank")["duration_ns"].median()
        table = per_step_times(window)
        if not table.empty:
            layers = table.columns.get_level_values(0)
            names = table.columns.get_level_values(1)
            total = table.drop(columns="step", level=0, errors="ignore").sum(axis=1)
            total = total.replace(0, np.nan)
            for feature, (layer, name) in SHARE_LAYERS.items():
                mask = np.isin(layers, layer) & ((names == name) if name else True)
                if mask.any():
                    share = table.loc[:, mask].sum(axis=1) / total
                    frame = frame.reindex(frame.index.union(share.index))
                    frame[feature] = share
        frame.index.name = "rank"
        return frame.dropna(axis=1, how="any").sort_index()

    def sample_counts(self, window: WindowView, raw: pd.DataFrame) -> pd.DataFrame:
        """How many observations each feature of each rank averages: metric samples for the
        metrics, steps for step time and shares (windows at the edges of a run hold fewer)."""
        metrics = window.metrics[window.metrics["rank"] >= 0]
        per_metric = metrics.groupby(["rank", "name"]).size().unstack("name")
        steps = window.steps.groupby("rank").size() if not window.steps.empty else None
        counts = pd.DataFrame(index=raw.index)
        for column in raw.columns:
            if column in METRIC_FEATURES:
                counts[column] = per_metric[column].reindex(raw.index)
            elif steps is not None:
                counts[column] = steps.reindex(raw.index)
            else:
                counts[column] = 1.0
        return counts.fillna(1.0).astype(float)

    def deviations(self, window: WindowView, raw: pd.DataFrame) -> pd.DataFrame:
        """Each feature relative to the peers' median: shares as differences, the rest as
        fractions of the median. Peers are the rank's pipeline stage when every stage has at
        least MIN_STAGE_PEERS ranks, else the whole job."""
        layout = window.rank_layout().reindex(raw.index)
        stage = layout["pp_stage"].fillna(0).astype(int)
        by_stage = stage.value_counts().min() >= MIN_STAGE_PEERS
        # The peers' median per column, computed per group (pandas' transform, per column, cost
        # more than the rest of the window's features).
        values, _ = group_medians(raw.to_numpy(dtype=float), stage.to_numpy() if by_stage else None)
        median = pd.DataFrame(values, index=raw.index, columns=raw.columns)
        out = raw - median
        relative = [c for c in raw.columns if not c.endswith("_share")]
        out[relative] = out[relative] / median[relative].abs().clip(lower=MEDIAN_FLOOR)
        return out

    # -- detection ----------------------------------------------------------------------------
    def detect(self, window: WindowView) -> list[Finding]:
        raw = self.features(window)
        if len(raw) < MIN_RANKS or raw.shape[1] == 0:
            return []
        self._windows += 1
        dev = self.deviations(window, raw)
        key = tuple(dev.columns)
        # A mean of fewer observations than usual is noisier: shrink its deviation by
        # sqrt(n / n_typical) so a short window at the end of a run is judged by the same
        # yardstick (a real fault of tens of percent stays far outside it).
        counts = self.sample_counts(window, raw).to_numpy()
        typical = self._typical_counts.get(key)
        if typical is None or self._windows <= self.grace_windows:
            typical = np.maximum(counts.max(axis=0), typical if typical is not None else 0)
            self._typical_counts[key] = typical
        shrink = np.sqrt(np.minimum(counts, typical) / typical)
        x = dev.to_numpy(dtype=np.float64) * shrink
        dev = pd.DataFrame(x, index=dev.index, columns=dev.columns)
        model = self._models.get(key)
        findings: list[Finding] = []
        flagged = np.zeros(len(dev), dtype=bool)
        if model is not None and self._windows > self.grace_windows:
            ll = model["gmm"].score_samples(x)
            strength = (model["threshold"] - ll) / model["scale"]
            flagged = strength >= self.min_strength
            peers = _Peers(window, raw)
            for i in np.flatnonzero(flagged):
                findings.append(self._finding(window, peers, dev, model, i, ll[i], strength[i]))
        self._learn(key, raw, dev, x, flagged)
        return findings

    def _learn(
        self,
        key: tuple[str, ...],
        raw: pd.DataFrame,
        dev: pd.DataFrame,
        x: np.ndarray,
        flagged: np.ndarray,
    ) -> None:
        healthy = ~flagged
        # The loose gate against faults present from the first window: a deviation from the
        # peers far beyond the others' spread (and beyond gate_floor) is not healthy.
        z, _ = robust_z_matrix(dev.to_numpy(dtype=float), None, self.gate_floor, rel_floor=0.0)
        with np.errstate(invalid="ignore"):
            healthy &= ~(np.abs(z) > self.healthy_gate_z).any(axis=1)  # NaN: not beyond
        if key not in self._history and len(self._history) >= MAX_FEATURE_SETS:
            oldest = next(iter(self._history))  # bounded: forget the oldest feature set
            for state in (self._history, self._models, self._typical_counts):
                state.pop(oldest, None)
        history = self._history.setdefault(key, deque(maxlen=self.history_vectors))
        history.extend(x[healthy])
        if len(history) >= self.min_train_vectors:
            self._models[key] = self._fit(np.array(history))

    def _fit(self, train: np.ndarray) -> dict[str, Any]:
        from sklearn.mixture import GaussianMixture  # imported on first fit only

        best, best_bic = None, np.inf
        # More components than distinct training vectors is degenerate: k-means (the EM
        # initialisation) cannot place them and scikit-learn warns. It happens in edge windows
        # whose only surviving feature is identical on every rank, e.g. a deviation of 0.
        distinct = len(np.unique(train, axis=0))
        for k in range(1, min(self.max_components, distinct) + 1):
            if len(train) < VECTORS_PER_COMPONENT * k:
                break
            gmm = GaussianMixture(
                n_components=k,
                covariance_type="diag",
                reg_covar=self.variance_floor,
                random_state=self.seed,
            )
            gmm.fit(train)
            bic = gmm.bic(train)
            if bic < best_bic:
                best, best_bic = gmm, bic
        assert best is not None  # len(train) >= min_train_vectors >= VECTORS_PER_COMPONENT
        ll = best.score_samples(train)
        threshold = float(np.quantile(ll, self.tail_quantile))
        scale = float(max(np.median(np.abs(ll - np.median(ll))) * MAD_TO_SIGMA, MIN_LL_SCALE))
        return {"gmm": best, "threshold": threshold, "scale": scale, "n_train": len(train)}

    def _finding(
        self,
        window: WindowView,
        peers: _Peers,
        dev: pd.DataFrame,
        model: dict[str, Any],
        i: int,
        ll: float,
        strength: float,
    ) -> Finding:
        gmm = model["gmm"]
        x = dev.to_numpy(dtype=np.float64)[i]
        component = int(gmm.predict(x[None, :])[0])
        z = (x - gmm.means_[component]) / np.sqrt(gmm.covariances_[component])
        order = np.argsort(-np.abs(z))
        rank = int(peers.raw.index[i])
        moved = [str(dev.columns[j]) for j in order[:FEATURES_NAMED]]
        # The category comes from the most specific cause among the features that moved
        # (|z| >= MOVED_Z), not simply the largest move: a throttled GPU is also busier for longer
        # (utilisation up) and waits less in collectives, but its SM clock drop is the cause.
        # A clock or power drop names gpu-throttle only when the GPU is held back more than
        # its peers: under a power cap a straggler's clock is lower because it computes while
        # its peers wait (trainscope/detectors/throttle.py), which is not throttling.
        category, best = "slowdown", len(CATEGORY_PRIORITY)
        throttled: bool | None = None
        for j in order:
            if abs(z[j]) < MOVED_Z:
                break
            move = (str(dev.columns[j]), int(np.sign(z[j])))
            if CATEGORY_OF_MOVE.get(move[0], {}).get(move[1]) == "gpu-throttle":
                if throttled is None:
                    throttled = peers.throttled(rank)
                if not throttled:
                    continue
            if move in CATEGORY_PRIORITY and CATEGORY_PRIORITY.index(move) < best:
                best = CATEGORY_PRIORITY.index(move)
                category = CATEGORY_OF_MOVE[move[0]][move[1]]
        evidence = {
            "log_likelihood": float(ll),
            "threshold": model["threshold"],
            "strength": float(strength),
        }
        parts = []
        for feature in moved:
            j = dev.columns.get_loc(feature)
            value, peer = peers.value(i, feature), peers.without(feature, rank)
            evidence[f"z:{feature}"] = float(z[j])
            evidence[f"value:{feature}"] = value
            evidence[f"peers:{feature}"] = peer
            parts.append(f"{feature} {value:.4g} vs peers {peer:.4g}")
        # min_strength maps to 0.5 (the alert threshold), twice that to 0.75, and so on.
        score = round(float(1.0 - 0.5 ** (strength / self.min_strength)), 4)
        return window.finding(
            self.name,
            rank=rank,
            ranks=[rank],
            category=category,
            score=score,
            evidence=evidence,
            message=(
                f"{category}: rank {rank}'s metrics are jointly unlikely under the mixture "
                f"fitted on healthy windows (log-likelihood {ll:.1f}, healthy tail "
                f"{model['threshold']:.1f}); moved most: {'; '.join(parts)}"
            ),
        )


class _Peers:
    """A window's raw features with what a finding compares them with, prepared once for all
    the window's findings: each feature's median over the other ranks (pandas' median of the
    column without the rank, by one sort per column) and the throttle rule's peer medians."""

    def __init__(self, window: WindowView, raw: pd.DataFrame) -> None:
        self.window = window
        self.raw = raw
        self._values = raw.to_numpy(dtype=float)  # a row of raw, as raw.iloc gives it
        self._others = PeerMedians(raw)
        self._throttle: tuple[PeerMedians, PeerMedians] | None = None

    def value(self, i: int, feature: str) -> float:
        return float(self._values[i, self.raw.columns.get_loc(feature)])

    def without(self, feature: str, rank: int) -> float:
        return self._others.without(feature, rank)

    def throttled(self, rank: int) -> bool:
        """Whether the rank's GPU is held back more than its peers'
        (:mod:`trainscope.detectors.throttle`)."""
        if self._throttle is None:
            self._throttle = (PeerMedians(throttling_shares(self.window)),
                              PeerMedians(metric_means(self.window)))
        throttled, _ = ThrottleRule().judge_with(*self._throttle, rank)
        return throttled
