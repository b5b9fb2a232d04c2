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
        evidence: dict[str, float] = {}
        throttled = False
        peers_capped = False
        if shares.has_peers(rank):
            capped = shares.without(POWER_CAP, rank)
            if np.isnan(capped):  # condensed readings: any throttling reason, mostly the cap
                capped = shares.without(ANY_THROTTLING, rank)
            peers_capped = bool(capped >= self.peers_capped_frac)  # False for NaN
        util = ratio_to_peers(means, m.SM_UTIL_PCT, rank)
        busier = util is not None and util >= BUSIER_UTIL_RATIO
        if util is not None:
            evidence["sm_util_ratio"] = util
        own_capped = False
        if rank in shares.frame.index:
            own = shares.frame.loc[rank]
            own_cap = own.get(POWER_CAP, np.nan)
            own_cap = own[ANY_THROTTLING] if pd.isna(own_cap) else own_cap
            own_capped = bool(own_cap >= self.peers_capped_frac)
            reference = pd.Series([shares.without(c, rank) for c in own.index],
                                  index=own.index, dtype=float).fillna(0.0)
            excess = (own - reference).dropna()
            evidence["throttled_frac"] = float(own[ANY_THROTTLING])
            evidence["peers_throttled_frac"] = float(reference[ANY_THROTTLING])
            if not excess.empty:
                evidence["throttled_excess_frac"] = float(excess.max())
                load_bound = excess.index.isin([POWER_CAP, ANY_THROTTLING])
                # The cap follows load: a busier rank's cap is not its GPU held back.
                throttled |= not busier and bool(
                    (excess[load_bound] >= self.power_cap_excess_frac).any())
                throttled |= bool((excess[~load_bound] >= self.excess_frac).any())
        limit = ratio_to_peers(means, m.POWER_LIMIT_W, rank)
        if limit is not None:
            evidence["power_limit_ratio"] = limit
            throttled |= limit <= self.power_limit_ratio_max
        clock = ratio_to_peers(means, m.SM_CLOCK_MHZ, rank)
        if clock is not None:
            evidence["sm_clock_ratio"] = clock
            throttled |= (clock <= self.clock_ratio_max and not peers_capped
                          and not (busier and own_capped))
        return throttled, evidence


def ratio_to_peers(means: PeerMedians, metric: str, rank: int) -> float | None:
    """A rank's window mean of ``metric`` over the median of the other ranks' (None if unknown)."""
    frame = means.frame
    if metric not in frame.columns or rank not in frame.index:
        return None
    own = float(frame.at[rank, metric])
    reference = means.without(metric, rank)
    if not (np.isfinite(own) and np.isfinite(reference)) or reference <= 0:
        return None
    return own / reference


class PeerMedians:
    """Each column's median over the ranks (the index) other than one, as pandas' ``median``
    of the column without that rank gives it (NaN skipped; NaN when nothing is left). Each
    column is sorted once, when first asked for; then every rank's answer is a lookup."""

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame
        self._sorted: dict[str, np.ndarray] = {}
        self._values: dict[str, np.ndarray] = {}
        # Row of each rank: a dict lookup, not pandas' (thousands of calls a window).
        self._row = {rank: i for i, rank in enumerate(frame.index.tolist())}

    def has_peers(self, rank: int) -> bool:
        """Whether a rank other than ``rank`` has a row."""
        return len(self.frame) - int(rank in self._row) > 0

    def without(self, column: str, rank: int) -> float:
        if column not in self.frame.columns:
            return np.nan
        values = self._sorted.get(column)
        if values is None:
            column_values = self._values[column] = self.frame[column].to_numpy(dtype=float)
            values = self._sorted[column] = np.sort(column_values[~np.isnan(column_values)])
        row = self._row.get(rank)
        own = float(self._values[column][row]) if row is not None else np.nan
        # Removing any one of equal values leaves the same numbers: the first will do.
        skip = int(np.searchsorted(values, own)) if not np.isnan(own) else len(values)
        left = len(values) - (skip < len(values))
        if left == 0:
            return np.nan

        def at(k: int) -> float:
            return float(values[k] if k < skip else values[k + 1])

        if left % 2:
            return at(left // 2)
        return (at(left // 2 - 1) + at(left // 2)) / 2
