"""Peer-diff's own-work suspects: every rank's time per step on each function of its own work,
against its pipeline-stage peers and its own history, scored for all ranks and functions at once.

The peer detector's docstring (:mod:`trainscope.detectors.peer`) says what is compared and why.
This module computes it as matrices (ranks × functions) rather than a pandas pass per function:
a 10,240-rank window of 60 functions is 600,000 cells, and a group-by per function and column
cost most of the detector's time. The statistics are the ones of
:func:`~trainscope.detectors.features.robust_z` (median and MAD per stage, NaN skipped, floors)
to the bit (:func:`~trainscope.detectors.features.robust_z_matrix`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainscope.detectors.features import (
    MAD_TO_SIGMA,
    OWN_WORK_CATEGORY,
    median_skipna,
    own_work_columns,
    quiet_nan,
    robust_z_matrix,
)
from trainscope.schemas import metrics as m

# The smallest spread a per-step time is judged against, as a share of the step: a function of
# a few microseconds whose peers agree to the nanosecond must not become a 50-sigma outlier.
NOISE_FLOOR_STEP_FRAC = 0.002
# Likewise against the rank's own history: a 2% wobble from window to window is noise (the same
# relative floor robust_z applies to peers).
HISTORY_REL_FLOOR = 0.02
# robust_z's relative floor against the peers.
PEER_REL_FLOOR = 0.02
# A median over fewer past windows is not robust: history is used from this many windows on.
MIN_HISTORY_WINDOWS = 3
# When at least this share of a stage's ranks are flagged against their history alone, the
# stage moved together (a job-wide change), not one rank.
CROWD_FRAC = 0.5
# A function on which the reference spends at most this share of the suspect's time is work
# the peers hardly do (see PeerDiffDetector._excess_floor).
ABSENT_ON_PEERS_FRAC = 0.1
# A rank's compute growth is its wait for a CPU when the rank is a cpu-contention suspect too,
# and its run-queue wait per step grew (over its stage's median) by at least as much as its
# compute and is at least twice that median: a thread runnable but not running is still inside
# forward by the wall clock, so a busy neighbour on its core shows as slower compute, by at
# most the wait. Twice: on a host where every rank shares the cores, a rank with more work of
# its own (a bigger shard) is runnable longer and waits more too, in proportion (1.4x its
# peers' wait for 4x the forward, fault matrix case (h)); a neighbour that takes the core
# doubles it at least (3.5x in case (c)).
CONTENTION_EXPLAINS_COMPUTE_FRAC = 1.0
CONTENTION_WAIT_RATIO = 2.0
COMPUTE_CATEGORIES = frozenset({"gpu-compute", "compute"})
CONTENTION_CATEGORY = "cpu-contention"


@dataclass
class Suspect:
    rank: int
    layer: str
    name: str
    category: str
    excess_ns: float
    z: float
    value_ns: float
    reference_ns: float
    source: str  # "peers", "history" or "stages"
    ranks: tuple[int, ...] = ()
    pp_stage: int = -1
    evidence: dict[str, float] | None = None


@dataclass(frozen=True)
class OwnWorkRule:
    """The thresholds of an own-work suspect (the peer detector's settings)."""

    z_min: float
    z_full: float
    min_excess_ns: float  # the detector's _min_excess for this window's step


def history_reference(
    history: list[pd.DataFrame], index: pd.Index, columns: pd.Index
) -> tuple[np.ndarray, np.ndarray] | None:
    """Each (rank, function)'s median and MAD over the past windows (ranks × functions), or
    None before ``MIN_HISTORY_WINDOWS`` windows."""
    if len(history) < MIN_HISTORY_WINDOWS:
        return None
    # Each cell's past windows side by side in memory: numpy sorts many short contiguous rows
    # two to three times faster than the same rows strided along the first axis (0.07 s a
    # window at 10,240 ranks and 8 windows, before).
    stack = np.stack([h.reindex(index=index, columns=columns).to_numpy(float) for h in history],
                     axis=-1)
    if np.isnan(stack).any():
        with quiet_nan():
            median = np.nanmedian(stack, axis=-1)
            return median, np.nanmedian(np.abs(stack - median[..., None]), axis=-1)
    # A few windows per cell: a sort along them, the middle one (or the mean of two).
    median = _middle(np.sort(stack, axis=-1))
    return median, _middle(np.sort(np.abs(stack - median[..., None]), axis=-1))


def _middle(ascending: np.ndarray) -> np.ndarray:
    n = ascending.shape[-1]
    if n % 2:
        return ascending[..., n // 2]
    return (ascending[..., n // 2 - 1] + ascending[..., n // 2]) / 2


def own_work_suspects(
    rule: OwnWorkRule,
    table: pd.DataFrame,
    stage: pd.Series,
    tokens: pd.Series | None,
    step_ns: float,
    history: list[pd.DataFrame],
) -> list[Suspect]:
    """Every rank and own-work function at least ``z_min`` above its reference (the stage's
    median, or the rank's own past, whichever stands out more) by ``min_excess_ns``, in the
    order of the functions, then of the ranks."""
    columns = own_work_columns(table.columns)
    if not columns:
        return []
    categories = [OWN_WORK_CATEGORY[layer] for layer, _ in columns]
    own = table[columns]
    x = own.to_numpy(dtype=float)
    stages = stage.to_numpy()
    min_excess = rule.min_excess_ns
    # Work the ranks hardly do at all (GC pauses, mostly) has no wobble that scales with the
    # step: there, time enough to report (min_excess) is evidence enough, and the step's noise
    # floor would hide a 10-ms pause per step in a long step.
    absent = median_skipna(x, axis=0) <= ABSENT_ON_PEERS_FRAC * min_excess
    floor = np.where(absent, min_excess / rule.z_full, NOISE_FLOOR_STEP_FRAC * step_ns)
    # Compare compute per token: longer sequences are not a slower GPU.
    per_token = np.array([tokens is not None and c == "gpu-compute" for c in categories])
    scale = np.ones_like(x)
    if tokens is not None and per_token.any():
        relative = (tokens / tokens.median()).to_numpy(dtype=float)
        scale[:, per_token] = relative[:, None]
    normalised = x / scale
    z_peer, ref_peer = robust_z_matrix(normalised, stages, floor, PEER_REL_FLOOR)
    excess_peer = (normalised - ref_peer) * scale
    z, excess, use_hist = z_peer, excess_peer, np.zeros_like(x, dtype=bool)
    reference = history_reference(history, table.index, own.columns)
    if reference is not None:
        h_med, h_mad = reference
        spread = np.maximum(np.maximum(MAD_TO_SIGMA * h_mad, HISTORY_REL_FLOOR * np.abs(h_med)),
                            floor)
        # Per token too: a rank that drew longer sequences is not slower than its past.
        with np.errstate(all="ignore"):
            z_hist = (normalised - h_med) / spread
        excess_hist = (normalised - h_med) * scale
        use_hist = _or_minus_inf(z_hist) > _or_minus_inf(z_peer)
        z = np.where(use_hist, z_hist, z_peer)
        excess = np.where(use_hist, excess_hist, excess_peer)
    with np.errstate(invalid="ignore"):
        flagged = (z >= rule.z_min) & (excess >= min_excess)
    flagged &= ~_crowded(flagged & use_hist, stages)
    return _suspects(flagged, table.index.to_numpy(), columns, categories, per_token, x, z,
                     excess, use_hist)


def _or_minus_inf(z: np.ndarray) -> np.ndarray:
    """NaN (no reference) as -inf, so that any z beats it."""
    return np.where(np.isnan(z), -np.inf, z)


def _crowded(hist_only: np.ndarray, stages: np.ndarray) -> np.ndarray:
    """Cells flagged against history alone in a stage where at least ``CROWD_FRAC`` of the
    ranks were, for that function: the stage moved together (a job-wide change), not one rank.
    """
    crowd = np.zeros_like(hist_only)
    if not hist_only.any():
        return crowd
    for s in np.unique(stages):
        rows = np.flatnonzero(stages == s)
        share = hist_only[rows].sum(axis=0) / len(rows)
        crowd[rows] = hist_only[rows] & (share >= CROWD_FRAC)
    return crowd


def _suspects(
    flagged: np.ndarray,
    ranks: np.ndarray,
    columns: list,
    categories: list[str],
    per_token: np.ndarray,
    x: np.ndarray,
    z: np.ndarray,
    excess: np.ndarray,
    use_hist: np.ndarray,
) -> list[Suspect]:
    cols, rows = np.nonzero(flagged.T)  # by function, then by rank, as the findings list them
    out = []
    for j, i, value, zi, e, hist in zip(cols.tolist(), rows.tolist(), x[rows, cols].tolist(),
                                        z[rows, cols].tolist(), excess[rows, cols].tolist(),
                                        use_hist[rows, cols].tolist(), strict=True):
        layer, name = columns[j]
        out.append(Suspect(
            rank=int(ranks[i]),
            layer=layer,
            name=name,
            category=categories[j],
            excess_ns=e,
            z=zi,
            value_ns=value,
            reference_ns=value - e,
            source="history" if hist else "peers",
            # Compared per token: not a rank that merely drew longer sequences.
            evidence={"per_token": 1.0} if per_token[j] else None,
        ))
    return out


def contended_compute(suspects: list[Suspect], table: pd.DataFrame,
                      stage: pd.Series) -> list[Suspect]:
    """The suspects, with each compute suspect whose growth its rank's wait for a CPU explains
    (``CONTENTION_EXPLAINS_COMPUTE_FRAC``, ``CONTENTION_WAIT_RATIO``) kept as evidence of that
    rank's ``cpu-contention`` suspect: the same time, counted once."""
    contention = {s.rank: s for s in suspects if s.category == CONTENTION_CATEGORY}
    # The agent's figure first, as features.runqueue_wait_per_step reads it.
    wait_cols = [(m.SCHED_LAYER, name) for name in m.RUNQUEUE_WAIT_FUNCTIONS
                 if (m.SCHED_LAYER, name) in table.columns]
    if not wait_cols or not any(s.category in COMPUTE_CATEGORIES and s.rank in contention
                                for s in suspects):
        return suspects
    wait = table[wait_cols[0]]
    usual = wait.groupby(stage).transform("median")
    kept = []
    for s in suspects:
        c = contention.get(s.rank)
        waited = float(wait.get(s.rank, np.nan) - usual.get(s.rank, np.nan))
        if (c is None or s.category not in COMPUTE_CATEGORIES or not s.excess_ns > 0
                or not waited >= CONTENTION_EXPLAINS_COMPUTE_FRAC * s.excess_ns
                or not wait[s.rank] >= CONTENTION_WAIT_RATIO * usual[s.rank]):
            kept.append(s)
            continue
        c.evidence = {**(c.evidence or {}), "compute_growth_ns_per_step": s.excess_ns,
                      "runqueue_wait_excess_ns_per_step": waited}
    return kept
