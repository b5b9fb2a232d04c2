"""Is a slow GPU throttled? Judged against its peers, never in absolute terms.

On a real cluster the absolute readings say little. Measured on an H100 (figures in
``benchmarks/README.md``, script ``benchmarks/gpu_throttle_duty.py``): a GPU computing all the
time reports ``sw_power_cap`` in 98–99% of its NVML readings, and so does one computing half of
every 400 ms step; with 5 s steps the share follows the load (56–60% at half of each step).
Under the cap the mean SM clock falls with load — 1366–1401 MHz computing all the time,
1536–1620 MHz at 70% of the step, 1659–1733 MHz at 50%. A straggler computes while its peers
wait for it, so it reads a lower clock and a larger power-cap share than they do, with nothing
wrong with its GPU. A GPU is throttled when it is held back more than its peers are:

- for a thermal, HW-slowdown or power-brake reason, its share of readings exceeds the peers'
  median share by ``excess_frac``; for the power cap, or for any reason where a producer
  condensed its readings (mostly the cap), by ``power_cap_excess_frac`` — more than the load of
  a straggler explains — and only when it is no busier than its peers (SM utilisation below
  ``BUSIER_UTIL_RATIO`` of theirs, or unknown): a GPU that computes while its peers wait for it
  reaches the cap they drop out of (in the simulator, where the cap follows utilisation, a 2×
  slow GPU is capped in every reading and its peers in none), which is its own load, not a GPU
  held back;
- its enforced power limit is at most ``power_limit_ratio_max`` of the peers' median — a GPU
  capped lower than the others shows the same ``sw_power_cap`` bit as they do;
- or its mean SM clock is at most ``clock_ratio_max`` of the peers' median, but only while the
  peers are not running at their power cap themselves, and the rank is not at its power cap
  while busier than they are (then nothing but throttling or a clock setting lowers one GPU's
  clock below the others').

So a GPU is throttled only on its own evidence (its reasons, limit or clock worse than its
peers' beyond what its own load explains), never because its peers left their power cap while
waiting for it: the rank they wait on keeps its own category (``gpu-compute``).

The peer detector applies this to its compute suspects; the mixture detector to a rank whose SM
clock or power dropped, before it names ``gpu-throttle``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainscope.detectors.features import ANY_THROTTLING
from trainscope.detectors.params import check_number
from trainscope.schemas import metrics as m
from trainscope.schemas.metrics import THROTTLE_REASON_NAMES

# NVML's "the GPU is at its power limit" reason: on an H100 every busy GPU reports it.
POWER_CAP = THROTTLE_REASON_NAMES[0x004]
# A rank whose mean SM utilisation is this much above its peers' median is busier than they are:
# its power cap (and the lower clock under it) is its load. Healthy peers agree within a few
# percent; a 1.3x straggler whose peers wait the rest of the step is ~1.3x as busy.
BUSIER_UTIL_RATIO = 1.1


@dataclass(frozen=True)
class ThrottleRule:
    """The rule of the module docstring, with its thresholds; ``judge`` applies it."""

    # A thermal, HW-slowdown or power-brake reason in a quarter more of the readings than the
    # peers' median share: a sustained fault shows in nearly all readings, a blip of one
    # reading in ten does not.
    excess_frac: float = 0.25
    # The power cap (or any reason, condensed) in 0.6 more of the readings: a straggler that
    # makes its peers wait half of every 5 s step shows it in 0.41 more of them on the H100,
    # and a window of a few readings adds its sampling noise (3 of 6 for a share of 0.58).
    power_cap_excess_frac: float = 0.6
    # The peers run at their power cap, so their clocks follow their load, when a quarter of
    # their readings carry it (on the H100, peers computing half of each 5 s step: 56-60%).
    peers_capped_frac: float = 0.25
    # An SM clock at most 0.9 of the peers' (a healthy GPU's clock varies by a few percent, a
    # thermal slowdown lowers it far more).
    clock_ratio_max: float = 0.9
    # An enforced power limit at most 0.9 of the peers'.
    power_limit_ratio_max: float = 0.9

    def check(self, detector: str) -> None:
        """DetectorConfigError, naming ``detector``, for a setting out of range."""
        check_number(detector, "throttled_excess_frac", self.excess_frac, gt=0, le=1)
        check_number(detector, "power_cap_excess_frac", self.power_cap_excess_frac, gt=0, le=1)
        check_number(detector, "peers_capped_frac", self.peers_capped_frac, gt=0, le=1)
        check_number(detector, "clock_ratio_max", self.clock_ratio_max, gt=0, lt=1)
        check_number(detector, "power_limit_ratio_max", self.power_limit_ratio_max, gt=0, lt=1)

    def judge(
        self, shares: pd.DataFrame, means: pd.DataFrame, rank: int
    ) -> tuple[bool, dict[str, float]]:
        """(throttled, evidence) of ``rank``, from the window's per-reason throttling shares
        (:func:`~trainscope.detectors.features.throttling_shares`) and metric means
        (:func:`~trainscope.detectors.features.metric_means`)."""
        return self.judge_with(PeerMedians(shares), PeerMedians(means), rank)

    def judge_with(
        self, shares: PeerMedians, means: PeerMedians, rank: int
    ) -> tuple[bool, dict[str, float]]:
        """``judge`` with the window's shares and means wrapped once for all the ranks judged
        in it (a 10,000-rank window with hundreds of suspects: one sort per column, not a
        median over the peers per suspect and column)."""
        return self.judge_ranks(shares, means, [rank])[0]

    def judge_ranks(
        self, shares: PeerMedians, means: PeerMedians, ranks: list[int]
    ) -> list[tuple[bool, dict[str, float]]]:
        """``judge_with`` of each of ``ranks``, as arrays over them: a window can hold
        thousands of compute suspects, and a pandas row per suspect cost more than the rule."""
        at = np.asarray(ranks, dtype=np.int64)
        in_shares = np.array([r in shares.row for r in ranks], dtype=bool)
        capped = shares.without_ranks(POWER_CAP, at)
        # Condensed readings: any throttling reason, mostly the cap.
        capped = np.where(np.isnan(capped), shares.without_ranks(ANY_THROTTLING, at), capped)
        has_peers = len(shares.frame) - in_shares.astype(np.int64) > 0
        with np.errstate(invalid="ignore"):
            peers_capped = has_peers & (capped >= self.peers_capped_frac)  # False for NaN
        util = ratios_to_peers(means, m.SM_UTIL_PCT, at)
        busier = ~np.isnan(util) & (util >= BUSIER_UTIL_RATIO)
        own = _OwnShares(self, shares, at, in_shares, busier)
        limit = ratios_to_peers(means, m.POWER_LIMIT_W, at)
        clock = ratios_to_peers(means, m.SM_CLOCK_MHZ, at)
        results = []
        for i in range(len(at)):
            evidence: dict[str, float] = {}
            if not np.isnan(util[i]):
                evidence["sm_util_ratio"] = float(util[i])
            throttled = own.judge(i, evidence)
            if not np.isnan(limit[i]):
                evidence["power_limit_ratio"] = float(limit[i])
                throttled |= bool(limit[i] <= self.power_limit_ratio_max)
            if not np.isnan(clock[i]):
                evidence["sm_clock_ratio"] = float(clock[i])
                throttled |= bool(clock[i] <= self.clock_ratio_max and not peers_capped[i]
                                  and not (busier[i] and own.capped[i]))
            results.append((throttled, evidence))
        return results


class _OwnShares:
    """The judged ranks' own throttling shares against their peers' medians (ranks × reasons)."""

    def __init__(self, rule: ThrottleRule, shares: PeerMedians, at: np.ndarray,
                 in_shares: np.ndarray, busier: np.ndarray) -> None:
        self.rule = rule
        self.present = in_shares
        self.busier = busier
        columns = list(shares.frame.columns)
        self.any = columns.index(ANY_THROTTLING) if in_shares.any() else -1
        table = shares.frame.to_numpy(dtype=float)
        rows = [shares.row.get(int(r), 0) for r in at]
        self.own = table[rows] if len(table) else np.full((len(at), len(columns)), np.nan)
        cap = columns.index(POWER_CAP) if POWER_CAP in columns else None
        own_cap = self.own[:, cap] if cap is not None else np.full(len(at), np.nan)
        if self.any >= 0:
            own_cap = np.where(np.isnan(own_cap), self.own[:, self.any], own_cap)
        with np.errstate(invalid="ignore"):
            self.capped = in_shares & (own_cap >= rule.peers_capped_frac)
        reference = np.column_stack([shares.without_ranks(c, at) for c in columns]) \
            if columns else np.empty((len(at), 0))
        self.reference = np.nan_to_num(reference, nan=0.0, posinf=np.inf, neginf=-np.inf)
        self.excess = self.own - self.reference  # NaN where the rank's own share is unknown
        self.load_bound = np.isin(columns, [POWER_CAP, ANY_THROTTLING])

    def judge(self, i: int, evidence: dict[str, float]) -> bool:
        """Whether rank ``i``'s shares say throttled; its share evidence added."""
        if not self.present[i]:
            return False
        evidence["throttled_frac"] = float(self.own[i, self.any])
        evidence["peers_throttled_frac"] = float(self.reference[i, self.any])
        excess = self.excess[i]
        known = ~np.isnan(excess)
        if not known.any():
            return False
        evidence["throttled_excess_frac"] = float(excess[known].max())
        # The cap follows load: a busier rank's cap is not its GPU held back.
        rule = self.rule
        throttled = not self.busier[i] and bool(
            (excess[known & self.load_bound] >= rule.power_cap_excess_frac).any())
        return throttled | bool((excess[known & ~self.load_bound] >= rule.excess_frac).any())


def ratio_to_peers(means: PeerMedians, metric: str, rank: int) -> float | None:
    """A rank's window mean of ``metric`` over the median of the other ranks' (None if unknown)."""
    ratio = float(ratios_to_peers(means, metric, np.array([rank], dtype=np.int64))[0])
    return None if np.isnan(ratio) else ratio


def ratios_to_peers(means: PeerMedians, metric: str, ranks: np.ndarray) -> np.ndarray:
    """``ratio_to_peers`` of each of ``ranks``, NaN where unknown."""
    frame = means.frame
    out = np.full(len(ranks), np.nan)
    if metric not in frame.columns:
        return out
    own = means.own(metric, ranks)
    reference = means.without_ranks(metric, ranks)
    valid = np.isfinite(own) & np.isfinite(reference)
    valid[valid] = reference[valid] > 0
    out[valid] = own[valid] / reference[valid]
    return out


class PeerMedians:
    """Each column's median over the ranks (the index) other than one, as pandas' ``median``
    of the column without that rank gives it (NaN skipped; NaN when nothing is left). Each
    column is sorted once, when first asked for; then every rank's answer is a lookup."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame
        self._sorted: dict[str, np.ndarray] = {}
        self._values: dict[str, np.ndarray] = {}
        # Row of each rank: a dict lookup, not pandas' (thousands of calls a window).
        self.row = {rank: i for i, rank in enumerate(frame.index.tolist())}

    def has_peers(self, rank: int) -> bool:
        """Whether a rank other than ``rank`` has a row."""
        return len(self.frame) - int(rank in self.row) > 0

    def without(self, column: str, rank: int) -> float:
        return float(self.without_ranks(column, np.array([rank], dtype=np.int64))[0])

    def own(self, column: str, ranks: np.ndarray) -> np.ndarray:
        """Each rank's own value of ``column`` (NaN for a rank without a row)."""
        values = self._column(column)[1]
        rows = np.array([self.row.get(int(r), -1) for r in ranks], dtype=np.int64)
        return np.where(rows >= 0, values[rows] if len(values) else np.nan, np.nan)

    def without_ranks(self, column: str, ranks: np.ndarray) -> np.ndarray:
        """``without`` of each of ``ranks``: the median of the sorted column with the rank's own
        value left out, by its position (a search), not a median per rank."""
        out = np.full(len(ranks), np.nan)
        if column not in self.frame.columns:
            return out
        values = self._column(column)[0]
        if len(values) == 0:
            return out
        own = self.own(column, ranks)
        # Removing any one of equal values leaves the same numbers: the first will do.
        skip = np.where(np.isnan(own), len(values), np.searchsorted(values, own))
        left = len(values) - (skip < len(values))
        half = left // 2

        def at(k: np.ndarray) -> np.ndarray:
            return values[np.clip(np.where(k < skip, k, k + 1), 0, len(values) - 1)]

        upper = at(half)
        median = np.where(left % 2 == 1, upper, (at(np.maximum(half - 1, 0)) + upper) / 2)
        return np.where(left > 0, median, np.nan)

    def _column(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(the column's known values sorted, its values by row), computed once."""
        if column not in self._sorted:
            values = self._values[column] = self.frame[column].to_numpy(dtype=float)
            self._sorted[column] = np.sort(values[~np.isnan(values)])
        return self._sorted[column], self._values[column]
