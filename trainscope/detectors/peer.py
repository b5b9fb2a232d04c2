"""Differential peer comparison: who is different, and what is it spending the time on?

For each function a rank runs on its own account (compute, data loading, GC, copies), the rank's
time per step is compared with its peers — the ranks of the same pipeline stage, which run the
same code on the same layers — and with its own recent history. Collective time is never taken
as a cause: in a synchronous job it is where the *victims* of a straggler spend their wait. The
cause is the rank whose own work grew; the victims are the ranks sharing a communication group
with it whose collective time grew instead.

Compute is compared per token when producers report tokens, so a rank that simply had longer
sequences this step is not mistaken for a slow GPU (that is sequence imbalance, another
detector's finding). A rank whose point-to-point sends or NIC throughput fall behind its peers
is a network suspect; a whole stage whose compute exceeds the other stages' is stage imbalance.

Score: ``confidence × share``, where share is the suspect's excess time per step over the
job's step-time excess (estimated from history, or from all suspects together when the job was
slow from the start), and confidence grows with the robust z-score. Two guards keep noise from
alerting: an excess below ``min_excess_ns`` per step is not actionable and never reported, and a
suspect seen in fewer than ``confirm_windows`` consecutive windows is capped below the alert
threshold — a straggler persists, a hiccup of a busy host does not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainscope.detectors.features import (
    MAD_TO_SIGMA,
    OWN_WORK_CATEGORY,
    WAIT_LAYERS,
    gpu_evidence,
    group_codes,
    honest_category,
    metric_means,
    own_work_columns,
    per_call_bandwidth,
    per_step_times,
    robust_z,
    step_time_ns,
    throttling_shares,
)
from trainscope.detectors.params import check_number, check_order
from trainscope.detectors.throttle import PeerMedians, ThrottleRule
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

# At most this many victims are listed per finding (a finding is one row in the store).
MAX_VICTIMS = 64
# Score cap for a suspect that has not persisted yet: visible in the store, not an alert.
UNCONFIRMED_SCORE_CAP = 0.45
# The smallest spread a per-step time is judged against, as a share of the step: a function of
# a few microseconds whose peers agree to the nanosecond must not become a 50-sigma outlier.
NOISE_FLOOR_STEP_FRAC = 0.002
# Likewise against the rank's own history: a 2% wobble from window to window is noise (the same
# relative floor robust_z applies to peers).
HISTORY_REL_FLOOR = 0.02
# A median over fewer past windows is not robust: history is used from this many windows on.
MIN_HISTORY_WINDOWS = 3
# When at least this share of a stage's ranks are flagged against their history alone, the
# stage moved together (a job-wide change), not one rank.
CROWD_FRAC = 0.5
# Confidence of a suspect exactly at z_min; it grows linearly to 1 at z_full.
MIN_CONFIDENCE = 0.5
# The healthy collective wait that network suspects and victims are measured from: the lower
# quartile of the job's, below the waits of a straggler's victims.
HEALTHY_QUANTILE = 0.25
# A rank related to a culprit is its victim when its wait grew by at least this share of the
# culprit's excess: it spends a material part of the delay waiting.
VICTIM_WAIT_FRAC = 0.25

# A function on which the reference spends at most this share of the suspect's time is work
# the peers hardly do (see PeerDiffDetector._excess_floor).
ABSENT_ON_PEERS_FRAC = 0.1
DETECTOR = "peer-diff"


@dataclass
class _Suspect:
    rank: int
    layer: str
    name: str
    category: str
    excess_ns: float
    z: float
    value_ns: float
    reference_ns: float
    source: str  # "peers" or "history"
    ranks: tuple[int, ...] = ()
    pp_stage: int = -1
    evidence: dict[str, float] | None = None


class PeerDiffDetector:
    """Finds the rank whose own work grew, by comparing every rank with its peers and its past.

    Each window, the summaries become the time per step of every (layer, function) on every
    rank. For each function a rank runs on its own account (compute, data loading, GC, copies),
    that time is compared with the rank's pipeline-stage peers (median and MAD: ranks of one
    stage run the same code on the same layers) and with the rank's own median over its recent
    windows, whichever stands out more; compute is compared per token when the steps report
    tokens. A rank ``z_min`` robust z above its reference, by at least ``min_excess_frac`` of
    the step and ``min_excess_ns``, is a suspect of the category its layer points to
    (``gpu-compute``, ``dataloader``, ``python-gc`` …), and a compute suspect is
    ``gpu-throttle`` when its GPU is held back more than its peers'
    (:mod:`trainscope.detectors.throttle`). A pipeline stage whose compute exceeds the other
    stages' is ``stage-imbalance``; a rank whose pipeline sends or NIC throughput fall behind
    its peers' is ``network``. Collective time is never a cause: the ranks of a suspect's TP,
    DP and PP groups whose collective wait grew are its victims. One finding per rank and
    cause names its costliest function; its score is confidence (from the z) times the
    suspect's share of the job's step-time excess.

    State, kept across windows and pickled with checkpoints: the per-step time tables and step
    times of the last ``history_windows`` windows (each rank's own reference, and the job's
    step-time baseline), and for each (rank, category) how many windows in a row it has been a
    suspect. Nothing is learned before the first window (the constructor only checks and stores
    its arguments), and the pipeline gives every job its own copy.

    Parameters
    ----------
    z_min : float, default 6.0 (robust z)
        Robust z (the MAD scaled to a standard deviation) at which a rank becomes a suspect.
        Ranks of one stage run the same code and agree closely, so 6 keeps chance out: at 6
        sigma a job of 10,240 ranks and 60 functions per window expects no false suspect.
    z_full : float, default 12.0 (robust z)
        Robust z at which a suspect's confidence reaches 1; it is 0.5 at ``z_min`` and grows
        linearly in between. Must be above ``z_min``.
    min_excess_frac : float, default 0.01 (fraction of the step)
        A suspect's excess over its reference must be at least this share of the job's step
        time ...
    min_excess_ns : float, default 1e6 (ns per step)
        ... and at least this much: an excess under 1% of the step, or under 1 ms per step,
        is not worth anyone's time, and is never reported.
    confirm_windows : int, default 2 (windows)
        Windows in a row a suspect must be seen before it can alert; until then its score is
        capped at 0.45, below the alert threshold. A straggler persists, a hiccup of a busy
        host does not.
    excess_floor_frac : float, default 0.03 (fraction of the step)
        A suspect's score is its share of the job's step-time excess, which is taken as at
        least this share of the step, so a small suspect in a healthy job cannot claim all of
        a near-zero excess (for work its peers hardly do, such as GC pauses, at least
        ``min_excess_frac`` and ``min_excess_ns``).
    stage_imbalance_frac : float, default 0.1 (fraction of the other stages' compute)
        A pipeline stage whose median compute per step is this much above the median of the
        other stages' is ``stage-imbalance``.
    throughput_drop_frac : float, default 0.2 (fraction of the peers' throughput)
        A rank whose pipeline-send or NIC throughput is this far below its peers' (and
        ``z_min`` robust z below them) is a ``network`` suspect.
    history_windows : int, default 8 (windows)
        Windows of each rank's own history kept as its reference (2 minutes at 15 s windows):
        long enough for a robust median, short enough to follow a job that changes phase. At
        least 3.
    throttled_excess_frac : float, default 0.25 (fraction of NVML readings)
        A compute suspect is ``gpu-throttle`` when a thermal, HW-slowdown or power-brake
        reason is in this much larger a share of its readings than in its peers' median
        share: a sustained fault shows in nearly all readings, a blip of one in ten does not.
    power_cap_excess_frac : float, default 0.6 (fraction of NVML readings)
        ... or when the power cap (or any reason, where a producer condensed its readings) is
        in this much larger a share: more than a straggler's own load explains, since a
        straggler computes while its peers wait; and only while its SM utilisation is under
        1.1 times its peers' (busier, its cap is its load: ``throttle.BUSIER_UTIL_RATIO``).
    peers_capped_frac : float, default 0.25 (fraction of NVML readings)
        The peers run at their power cap, so their clocks follow their load and a lower clock
        proves nothing, when this share of their readings carries the cap.
    clock_ratio_max : float, default 0.9 (ratio to the peers' median)
        ... or when its SM clock is at most this ratio of its peers' median while they are not
        at their power cap (a healthy GPU's clock varies by a few percent).
    power_limit_ratio_max : float, default 0.9 (ratio to the peers' median)
        ... or when its enforced power limit is at most this ratio of its peers' median.

    Examples
    --------
    Two windows of a job of 2 stages × 4 ranks whose rank 5 runs its backward pass 1.4 times
    slower: the first finding is capped below the alert threshold, the second is confirmed.

    >>> from trainscope.detectors.contract import example_windows
    >>> detector = PeerDiffDetector()
    >>> first, second = example_windows(2, slow_rank=5)
    >>> [(f.category, f.rank, f.score) for f in detector.detect(first)]
    [('gpu-compute', 5, 0.45)]
    >>> finding, = detector.detect(second)
    >>> finding.category, finding.rank, finding.layer, finding.function, finding.score
    ('gpu-compute', 5, 'torch_op', 'backward', 1.0)
    >>> round(finding.evidence["excess_ns_per_step"] / 1e6), finding.victims  # ms per step
    (84, [1, 4, 6, 7])
    """

    name = DETECTOR

    def __init__(
        self,
        z_min: float = 6.0,
        z_full: float = 12.0,
        min_excess_frac: float = 0.01,
        min_excess_ns: float = 1e6,
        confirm_windows: int = 2,
        excess_floor_frac: float = 0.03,
        stage_imbalance_frac: float = 0.10,
        throughput_drop_frac: float = 0.2,
        history_windows: int = 8,
        # The ThrottleRule's fields (trainscope/detectors/throttle.py), under peer-diff's names.
        throttled_excess_frac: float = ThrottleRule.excess_frac,
        power_cap_excess_frac: float = ThrottleRule.power_cap_excess_frac,
        peers_capped_frac: float = ThrottleRule.peers_capped_frac,
        clock_ratio_max: float = ThrottleRule.clock_ratio_max,
        power_limit_ratio_max: float = ThrottleRule.power_limit_ratio_max,
    ) -> None:
        check_number(DETECTOR, "z_min", z_min, gt=0)
        check_number(DETECTOR, "z_full", z_full, gt=0)
        check_order(DETECTOR, "z_min", z_min, "z_full", z_full)
        check_number(DETECTOR, "min_excess_frac", min_excess_frac, ge=0, lt=1)
        check_number(DETECTOR, "min_excess_ns", min_excess_ns, ge=0)
        check_number(DETECTOR, "confirm_windows", confirm_windows, ge=1, integer=True)
        check_number(DETECTOR, "excess_floor_frac", excess_floor_frac, gt=0, le=1)
        check_number(DETECTOR, "stage_imbalance_frac", stage_imbalance_frac, gt=0)
        check_number(DETECTOR, "throughput_drop_frac", throughput_drop_frac, gt=0, lt=1)
        check_number(DETECTOR, "history_windows", history_windows, ge=MIN_HISTORY_WINDOWS,
                     integer=True)
        ThrottleRule(throttled_excess_frac, power_cap_excess_frac, peers_capped_frac,
                     clock_ratio_max, power_limit_ratio_max).check(DETECTOR)
        self.z_min = z_min
        self.z_full = z_full
        self.min_excess_frac = min_excess_frac
        self.min_excess_ns = min_excess_ns
        self.confirm_windows = confirm_windows
        self.excess_floor_frac = excess_floor_frac
        self.stage_imbalance_frac = stage_imbalance_frac
        self.throughput_drop_frac = throughput_drop_frac
        self.history_windows = history_windows
        self.throttled_excess_frac = throttled_excess_frac
        self.power_cap_excess_frac = power_cap_excess_frac
        self.peers_capped_frac = peers_capped_frac
        self.clock_ratio_max = clock_ratio_max
        self.power_limit_ratio_max = power_limit_ratio_max
        self._streaks: dict[tuple[int, str], int] = {}
        self._history: list[pd.DataFrame] = []
        self._step_history: list[float] = []
        # Whether this job ever showed GPU evidence (a GPU layer or metric): a window without
        # a GPU reading does not turn a GPU job's compute into CPU compute.
        self._gpu_seen = False

    def __setstate__(self, state: dict[str, object]) -> None:
        # A checkpoint written before a setting existed restores with that setting's default,
        # so an upgraded pipeline carries on instead of isolating the detector.
        self.__dict__.update({**PeerDiffDetector().__dict__, **state})

    # -- entry point ------------------------------------------------------------------------

    def detect(self, window: WindowView) -> list[Finding]:
        table = per_step_times(window)
        if table.empty:
            return []
        step_ns = step_time_ns(window)
        if not np.isfinite(step_ns):
            step_ns = float(table.sum(axis=1).median())
        layout = window.rank_layout().reindex(table.index)
        stage = layout["pp_stage"].fillna(0).astype(int)
        tokens = self._tokens_per_step(window, table.index)

        suspects = self._own_work_suspects(table, stage, tokens, step_ns)
        stage_suspects = self._stage_suspects(table, stage, step_ns)
        for s in stage_suspects:  # a stage-wide slowdown is one finding, not one per rank
            suspects = [
                x for x in suspects
                if not (x.category == "gpu-compute" and stage.get(x.rank) == s.pp_stage
                        and x.source == "history")
            ]
        suspects += stage_suspects
        suspects += self._network_suspects(window, table, stage, step_ns)
        self._categorise_compute(window, suspects)
        self._gpu_seen = self._gpu_seen or gpu_evidence(window)
        for x in suspects:
            x.category = honest_category(x.category, self._gpu_seen)
        findings = self._findings(window, table, layout, suspects, step_ns)
        self._remember(table, step_ns)
        return findings

    def _min_excess(self, step_ns: float) -> float:
        return max(self.min_excess_frac * step_ns, self.min_excess_ns)

    # -- suspects ---------------------------------------------------------------------------

    @staticmethod
    def _tokens_per_step(window: WindowView, ranks: pd.Index) -> pd.Series | None:
        steps = window.steps
        if steps.empty or (steps["tokens"] <= 0).all():
            return None
        per_rank = steps.groupby("rank")["tokens"].mean().reindex(ranks)
        return per_rank if per_rank.notna().all() and (per_rank > 0).all() else None

    def _history_reference(self, table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame] | None:
        if len(self._history) < MIN_HISTORY_WINDOWS:
            return None
        stack = np.stack(
            [h.reindex(index=table.index, columns=table.columns).to_numpy(float)
             for h in self._history]
        )
        # A (rank, function) cell absent from every past window has no reference: its median
        # is NaN on purpose, and numpy's "All-NaN slice" warning says only that.
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
            median = np.nanmedian(stack, axis=0)
            mad = np.nanmedian(np.abs(stack - median), axis=0)
        frame = lambda a: pd.DataFrame(a, index=table.index, columns=table.columns)  # noqa: E731
        return frame(median), frame(mad)

    def _own_work_suspects(
        self, table: pd.DataFrame, stage: pd.Series, tokens: pd.Series | None, step_ns: float
    ) -> list[_Suspect]:
        step_floor = NOISE_FLOOR_STEP_FRAC * step_ns
        min_excess = self._min_excess(step_ns)
        history = self._history_reference(table)
        suspects: list[_Suspect] = []
        for layer, name in own_work_columns(table.columns):
            category = OWN_WORK_CATEGORY[layer]
            x = table[(layer, name)]
            # Work the ranks hardly do at all (GC pauses, mostly) has no wobble that scales with
            # the step: there, time enough to report (min_excess) is evidence enough, and the
            # step's noise floor would hide a 10-ms pause per step in a long step.
            absent = float(x.median()) <= ABSENT_ON_PEERS_FRAC * min_excess
            floor = min_excess / self.z_full if absent else step_floor
            # Compare compute per token: longer sequences are not a slower GPU.
            per_token = tokens is not None and category == "gpu-compute"
            scale = tokens / tokens.median() if per_token else pd.Series(1.0, index=x.index)
            normalised = x / scale
            z_peer, ref_peer = robust_z(normalised, stage, floor)
            excess_peer = (normalised - ref_peer) * scale
            z_hist = pd.Series(np.nan, index=x.index)
            excess_hist = pd.Series(np.nan, index=x.index)
            if history is not None:
                h_med, h_mad = history[0][(layer, name)], history[1][(layer, name)]
                relative = HISTORY_REL_FLOOR * h_med.abs()
                spread = np.maximum(np.maximum(MAD_TO_SIGMA * h_mad, relative), floor)
                # Per token too: a rank that drew longer sequences is not slower than its past.
                z_hist = (normalised - h_med) / spread
                excess_hist = (normalised - h_med) * scale
            use_hist = z_hist.fillna(-np.inf) > z_peer.fillna(-np.inf)
            z = z_peer.where(~use_hist, z_hist)
            excess = excess_peer.where(~use_hist, excess_hist)
            flagged = (z >= self.z_min) & (excess >= self._min_excess(step_ns))
            # History alone cannot tell a straggler from a job-wide change: if most of a
            # stage moved together, it is not one rank's problem.
            hist_only = flagged & use_hist
            crowd = hist_only.groupby(stage).transform("mean") >= CROWD_FRAC
            flagged &= ~(hist_only & crowd)
            for rank in x.index[flagged.fillna(False)]:
                hist = bool(use_hist[rank])
                suspects.append(
                    _Suspect(
                        rank=int(rank),
                        layer=layer,
                        name=name,
                        category=category,
                        excess_ns=float(excess[rank]),
                        z=float(z[rank]),
                        value_ns=float(x[rank]),
                        reference_ns=float(x[rank] - excess[rank]),
                        source="history" if hist else "peers",
                        # Compared per token: not a rank that merely drew longer sequences.
                        evidence={"per_token": 1.0} if per_token else None,
                    )
                )
        return suspects

    def _stage_suspects(
        self, table: pd.DataFrame, stage: pd.Series, step_ns: float
    ) -> list[_Suspect]:
        compute_cols = [c for c in table.columns if OWN_WORK_CATEGORY.get(c[0]) == "gpu-compute"]
        if stage.nunique() < 2 or not compute_cols:
            return []
        compute = table[compute_cols].sum(axis=1)
        stage_median = compute.groupby(stage).median()
        suspects = []
        for s, value in stage_median.items():
            others = float(stage_median.drop(s).median())
            if others <= 0:
                continue
            frac = value / others - 1.0
            excess = value - others
            if frac < self.stage_imbalance_frac or excess < self._min_excess(step_ns):
                continue
            ranks = tuple(int(r) for r in stage.index[stage == s])
            main = table.loc[list(ranks), compute_cols].median().idxmax()
            suspects.append(
                _Suspect(
                    rank=min(ranks),
                    layer=main[0],
                    name=main[1],
                    category="stage-imbalance",
                    excess_ns=float(excess),
                    # Map the relative excess onto the z scale: 1× threshold → z_min.
                    z=float(self.z_min * frac / self.stage_imbalance_frac),
                    value_ns=float(value),
                    reference_ns=others,
                    source="stages",
                    ranks=ranks,
                    pp_stage=int(s),
                    evidence={"stage_excess_frac": float(frac)},
                )
            )
        return suspects

    def _network_suspects(
        self, window: WindowView, table: pd.DataFrame, stage: pd.Series, step_ns: float
    ) -> list[_Suspect]:
        signals: dict[int, tuple[float, float, str]] = {}  # rank → (z, drop, signal)

        def consider(values: pd.Series, groups: pd.Series | None, signal: str) -> None:
            values = values.dropna()
            if values.empty:
                return
            z, ref = robust_z(-values, None if groups is None else groups.reindex(values.index),
                              floor=0.0)
            drop = 1.0 - values / (-ref)
            hit = (z >= self.z_min) & (drop >= self.throughput_drop_frac)
            for rank in values.index[hit.fillna(False)]:
                if rank not in signals or z[rank] > signals[rank][0]:
                    signals[int(rank)] = (float(z[rank]), float(drop[rank]), signal)

        bandwidth = per_call_bandwidth(window)
        for layer, name in bandwidth.columns:
            # Point-to-point sends are transfer-bound; receives and collectives include waits.
            if layer in WAIT_LAYERS and "send" in name:
                consider(bandwidth[(layer, name)], stage, f"{name} throughput")
        means = metric_means(window)
        for metric in (m.NIC_TX_BYTES_PER_S, m.NIC_RX_BYTES_PER_S):
            if metric in means.columns:
                consider(means[metric], None, metric)
        if not signals:
            return []
        wait_cols = [c for c in table.columns if c[0] in WAIT_LAYERS]
        healthy = table[wait_cols].groupby(stage).transform(lambda c: c.quantile(HEALTHY_QUANTILE))
        wait_excess = (table[wait_cols] - healthy).clip(lower=0).sum(axis=1)
        suspects = []
        for rank, (z, drop, signal) in signals.items():
            excess = float(wait_excess.get(rank, 0.0))
            if excess < self._min_excess(step_ns):
                continue
            worst = (table.loc[rank, wait_cols] - healthy.loc[rank]).idxmax()
            suspects.append(
                _Suspect(
                    rank=rank,
                    layer=worst[0],
                    name=worst[1],
                    category="network",
                    excess_ns=excess,
                    z=z,
                    value_ns=float(table.loc[rank, worst]),
                    reference_ns=float(healthy.loc[rank, worst]),
                    source="peers",
                    evidence={"throughput_drop_frac": drop, f"signal:{signal}": 1.0},
                )
            )
        return suspects

    def _categorise_compute(self, window: WindowView, suspects: list[_Suspect]) -> None:
        """A compute suspect whose GPU is held back more than its peers' is throttled
        (:mod:`trainscope.detectors.throttle` says how, and why relative to the peers)."""
        if not any(s.category == "gpu-compute" for s in suspects):
            return
        rule = ThrottleRule(self.throttled_excess_frac, self.power_cap_excess_frac,
                            self.peers_capped_frac, self.clock_ratio_max,
                            self.power_limit_ratio_max)
        means = PeerMedians(metric_means(window))
        shares = PeerMedians(throttling_shares(window))
        for s in suspects:
            if s.category != "gpu-compute":
                continue
            throttled, evidence = rule.judge_with(shares, means, s.rank)
            s.evidence = {**(s.evidence or {}), **evidence} or None
            if throttled:
                s.category = "gpu-throttle"

    # -- findings ---------------------------------------------------------------------------

    def _findings(
        self,
        window: WindowView,
        table: pd.DataFrame,
        layout: pd.DataFrame,
        suspects: list[_Suspect],
        step_ns: float,
    ) -> list[Finding]:
        if not suspects:
            self._streaks = {}
            return []
        merged: dict[tuple[int, str], _Suspect] = {}
        totals: dict[tuple[int, str], float] = {}
        for s in suspects:  # one finding per rank and cause, naming its costliest function
            key = (s.rank, s.category)
            totals[key] = totals.get(key, 0.0) + s.excess_ns
            if key not in merged or s.excess_ns > merged[key].excess_ns:
                merged[key] = s
        step_excess = max(self._step_excess(step_ns), sum(totals.values()))
        wait_cols = [c for c in table.columns if c[0] in WAIT_LAYERS]
        waits = table[wait_cols].sum(axis=1) if wait_cols else pd.Series(0.0, index=table.index)
        groups = _Groups(layout, waits)
        larger = _LargerElsewhere(totals, groups)
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in merged}
        findings = []
        for key, s in merged.items():
            excess = totals[key]
            # Stragglers on different ranks overlap (every rank waits for the slowest in the
            # same collectives), so a smaller second fault barely moves the step while the
            # first is there, and would never reach the alert threshold as a share of the
            # whole excess. Its share is of what the larger suspects elsewhere leave, unless
            # it is their echo: the other end of a slow link (its pipeline neighbour's).
            larger_elsewhere = larger.than(s.rank, s.category, excess)
            share = min(1.0, excess / max(step_excess - larger_elsewhere,
                                          self._excess_floor(s, step_ns)))
            confidence = float(np.clip(
                MIN_CONFIDENCE
                + (1.0 - MIN_CONFIDENCE) * (s.z - self.z_min) / (self.z_full - self.z_min),
                MIN_CONFIDENCE,
                1.0,
            ))
            score = confidence * share
            if self._streaks[key] < self.confirm_windows:
                score = min(score, UNCONFIRMED_SCORE_CAP)
            ranks = list(s.ranks) or [s.rank]
            victims = _victims(groups, ranks, excess, s.category == "network")
            evidence = {
                "excess_ns_per_step": excess,
                "value_ns_per_step": s.value_ns,
                "reference_ns_per_step": s.reference_ns,
                "z": s.z,
                "step_ns": step_ns,
                "share_of_step_excess": share,
                "consecutive_windows": float(self._streaks[key]),
                **(s.evidence or {}),
            }
            findings.append(
                window.finding(
                    self.name,
                    rank=s.rank,
                    ranks=ranks,
                    victims=victims,
                    pp_stage=s.pp_stage,
                    layer=s.layer,
                    function=s.name,
                    category=s.category,
                    score=round(score, 4),
                    evidence=evidence,
                    message=_message(s, layout, excess, share, len(victims)),
                )
            )
        findings.sort(key=lambda f: f.score, reverse=True)
        return findings

    def _excess_floor(self, s: _Suspect, step_ns: float) -> float:
        """The least step-time excess a suspect's share is taken of. The floor keeps a small
        wobble of a large function from claiming all of a near-zero excess; time in work its
        peers hardly do at all (GC pauses, data-loader waits) is no wobble, so there the
        floor is only the smallest excess ever reported."""
        if s.reference_ns <= ABSENT_ON_PEERS_FRAC * s.value_ns:
            return self._min_excess(step_ns)
        return self.excess_floor_frac * step_ns

    def _step_excess(self, step_ns: float) -> float:
        if len(self._step_history) < MIN_HISTORY_WINDOWS:
            return 0.0
        return max(0.0, step_ns - float(np.median(self._step_history)))

    def _remember(self, table: pd.DataFrame, step_ns: float) -> None:
        self._history = [*self._history, table][-self.history_windows :]
        if np.isfinite(step_ns):
            self._step_history = [*self._step_history, step_ns][-self.history_windows :]


class _Groups:
    """The window's ranks by communicator group (TP: stage and DP rank; DP: stage and TP rank;
    PP: DP and TP rank) as integer codes, with each rank's collective time, so that the
    victims and pipeline neighbours of hundreds of suspects in a 10,000-rank window are array
    lookups rather than a pass over the layout per suspect."""

    def __init__(self, layout: pd.DataFrame, waits: pd.Series) -> None:
        self.ranks = layout.index.to_numpy()
        self.position = {int(r): i for i, r in enumerate(self.ranks)}
        # A rank outside the declared topology has no coordinates (NaN): it shares no group.
        self.stage = layout["pp_stage"].to_numpy(dtype=float)
        self.tp_group, self.dp_group, self.pp_group = (
            group_codes(layout, keys).to_numpy()
            for keys in (["pp_stage", "dp_rank"], ["pp_stage", "tp_rank"],
                         ["dp_rank", "tp_rank"]))
        self.waits = waits
        # Each rank's collective time, by position; NaN for a rank that has none.
        self.wait_at = waits.reindex(layout.index).to_numpy(dtype=float)
        self._healthy_wait: float | None = None
        self._by_pipeline: dict[tuple[int, int], int] | None = None

    def healthy_wait(self) -> float:
        """The job's lower quartile of collective time (computed once)."""
        if self._healthy_wait is None:
            self._healthy_wait = float(self.waits.quantile(HEALTHY_QUANTILE))
        return self._healthy_wait

    def pipeline_neighbours(self, rank: int) -> list[int]:
        """The ranks one pipeline link away from ``rank`` (the stages before and after it)."""
        i = self.position.get(rank)
        if i is None or np.isnan(self.stage[i]):
            return []
        if self._by_pipeline is None:
            self._by_pipeline = {(int(g), int(st)): int(r) for g, st, r
                                 in zip(self.pp_group, self.stage, self.ranks, strict=True)
                                 if not np.isnan(st)}
        key = int(self.pp_group[i])
        return [r for st in (self.stage[i] - 1, self.stage[i] + 1)
                if (r := self._by_pipeline.get((key, int(st)))) is not None]


class _LargerElsewhere:
    """For each suspect, the summed excess of the larger suspects on other ranks, leaving out
    the other end of a slow link (a network suspect on a pipeline neighbour): a sort and a
    running sum, not a pass over every suspect per suspect."""

    def __init__(self, totals: dict[tuple[int, str], float], groups: _Groups) -> None:
        self._totals = totals
        self._groups = groups
        self._ascending = np.sort(np.fromiter(totals.values(), dtype=float, count=len(totals)))
        self._running = np.concatenate([[0.0], np.cumsum(self._ascending)])
        self._by_rank: dict[int, list[float]] = {}
        for (rank, _), excess in totals.items():
            self._by_rank.setdefault(rank, []).append(excess)

    def than(self, rank: int, category: str, excess: float) -> float:
        above = int(np.searchsorted(self._ascending, excess, side="right"))
        larger = float(self._running[-1] - self._running[above])
        larger -= sum(e for e in self._by_rank[rank] if e > excess)
        if category == "network":
            for neighbour in self._groups.pipeline_neighbours(rank):
                e = self._totals.get((neighbour, "network"), 0.0)
                if e > excess:
                    larger -= e
        return max(larger, 0.0)


def _victims(
    groups: _Groups,
    culprits: list[int],
    excess: float,
    culprit_waits_too: bool = False,
) -> list[int]:
    """Ranks sharing a TP, DP or PP group with a culprit whose collective time is inflated."""
    waits = groups.waits
    if waits.empty:
        return []
    # Everyone in a synchronous job waits for a straggler, so the healthy reference is the
    # culprit's own wait: it arrives last and waits least. A slow link is the exception: the
    # culprit sits in the slow collective too, so compare with the job's lower quartile.
    at = np.array([groups.position[r] for r in culprits if r in groups.position], dtype=np.int64)
    own = groups.wait_at[at]
    own = own[~np.isnan(own)]
    baseline = float(own.min()) if len(own) and not culprit_waits_too else groups.healthy_wait()
    if at.size == 1:  # the usual case: a comparison, not isin's sort (720 calls a window)
        one = int(at[0])
        related = ((groups.tp_group == groups.tp_group[one])
                   | (groups.dp_group == groups.dp_group[one])
                   | (groups.pp_group == groups.pp_group[one]))
    else:
        related = (np.isin(groups.tp_group, groups.tp_group[at])
                   | np.isin(groups.dp_group, groups.dp_group[at])
                   | np.isin(groups.pp_group, groups.pp_group[at]))
    related[at] = False
    inflated = np.nan_to_num(groups.wait_at) >= baseline + VICTIM_WAIT_FRAC * excess
    return [int(r) for r in groups.ranks[related & inflated][:MAX_VICTIMS]]


def _message(s: _Suspect, layout: pd.DataFrame, excess: float, share: float, victims: int) -> str:
    ms = 1e-6
    if s.category == "stage-imbalance":
        who = f"pipeline stage {s.pp_stage} ({len(s.ranks)} ranks)"
        # The figures are the stage's whole compute per rank and step; the function is where
        # most of it goes.
        what = (
            f"compute {s.value_ns * ms:.0f} ms/step vs {s.reference_ns * ms:.0f} ms on other "
            f"stages, most in {s.layer}/{s.name}"
        )
    else:
        where = ""
        if s.rank in layout.index:
            row = layout.loc[s.rank]
            where = f" (dp {row['dp_rank']}, stage {row['pp_stage']}, tp {row['tp_rank']})"
        who = f"rank {s.rank}{where}"
        if s.category == "network":
            drop = (s.evidence or {}).get("throughput_drop_frac", 0.0)
            what = (
                f"network throughput {drop:.0%} below peers; {s.layer}/{s.name} "
                f"{s.value_ns * ms:.0f} ms/step vs {s.reference_ns * ms:.0f} ms"
            )
        else:
            against = "its history" if s.source == "history" else "peers"
            what = (
                f"{s.layer}/{s.name} {s.value_ns * ms:.0f} ms/step vs "
                f"{s.reference_ns * ms:.0f} ms on {against}"
            )
    return (
        f"{s.category}: {who}: {what} (+{excess * ms:.0f} ms/step, {share:.0%} of the step-time "
        f"excess); {victims} rank(s) wait on it"
    )
