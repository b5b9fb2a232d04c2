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
suspect seen in fewer than ``confirm_windows`` of the last ``confirm_windows + 1`` windows is
capped below the alert threshold — a straggler persists, a hiccup of a busy host does not (one
window in which the straggler's cause showed under another name, or not at all while a profile
slowed every rank, does not start it over).
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
    per_call_bandwidth,
    per_step_times,
    robust_z,
    step_time_ns,
    throttling_shares,
)
from trainscope.detectors.params import check_number, check_order
from trainscope.detectors.peer_groups import (
    HEALTHY_QUANTILE,
    Groups,
    LargerElsewhere,
    victims_many,
)
from trainscope.detectors.peer_own import (
    ABSENT_ON_PEERS_FRAC,
    MIN_HISTORY_WINDOWS,
    OwnWorkRule,
    Suspect,
    contended_compute,
    own_work_suspects,
)
from trainscope.detectors.throttle import PeerMedians, ThrottleRule
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

# Score cap for a suspect that has not persisted yet: visible in the store, not an alert.
UNCONFIRMED_SCORE_CAP = 0.45
# Score cap for a rank's wait for a CPU that no peer waits on: the host's cores were busy
# (another job, a test suite) and the rank waited more than it used to, but it did not arrive
# late at its collectives, so it held nobody up. Evidence, not an alert.
UNFELT_CONTENTION_SCORE_CAP = 0.45
# Confidence of a suspect exactly at z_min; it grows linearly to 1 at z_full.
MIN_CONFIDENCE = 0.5
DETECTOR = "peer-diff"


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
    (:mod:`trainscope.detectors.throttle`), and part of the rank's ``cpu-contention`` when its
    run-queue wait grew at least as much and is twice its peers' (a thread runnable but not
    running is still inside ``forward`` by the wall clock: a busy neighbour on its core). A
    pipeline stage whose compute exceeds the other stages' is ``stage-imbalance``; a rank whose
    pipeline sends or NIC throughput fall behind its peers' is ``network``. Collective time is
    never a cause: the ranks of a suspect's TP, DP and PP groups whose collective wait grew are
    its victims. One finding per rank and cause names its costliest function; its score is
    confidence (from the z) times the suspect's share of the job's step-time excess.

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
        Windows a suspect must be seen in, of the last ``confirm_windows + 1``, before it can
        alert; until then its score is capped at 0.45, below the alert threshold. A straggler
        persists, a hiccup of a busy host does not.
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
        # The suspects (rank, cause) of the last confirm_windows windows, newest last.
        self._recent: list[frozenset[tuple[int, str]]] = []
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
        suspects = contended_compute(suspects, table, stage)
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

    def _own_work_suspects(
        self, table: pd.DataFrame, stage: pd.Series, tokens: pd.Series | None, step_ns: float
    ) -> list[Suspect]:
        rule = OwnWorkRule(self.z_min, self.z_full, self._min_excess(step_ns))
        return own_work_suspects(rule, table, stage, tokens, step_ns, self._history)

    def _stage_suspects(
        self, table: pd.DataFrame, stage: pd.Series, step_ns: float
    ) -> list[Suspect]:
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
                Suspect(
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
    ) -> list[Suspect]:
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
                Suspect(
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

    def _categorise_compute(self, window: WindowView, suspects: list[Suspect]) -> None:
        """A compute suspect whose GPU is held back more than its peers' is throttled
        (:mod:`trainscope.detectors.throttle` says how, and why relative to the peers)."""
        if not any(s.category == "gpu-compute" for s in suspects):
            return
        rule = ThrottleRule(self.throttled_excess_frac, self.power_cap_excess_frac,
                            self.peers_capped_frac, self.clock_ratio_max,
                            self.power_limit_ratio_max)
        means = PeerMedians(metric_means(window))
        shares = PeerMedians(throttling_shares(window))
        compute = [s for s in suspects if s.category == "gpu-compute"]
        judged = rule.judge_ranks(shares, means, [s.rank for s in compute])
        for s, (throttled, evidence) in zip(compute, judged, strict=True):
            s.evidence = {**(s.evidence or {}), **evidence} or None
            if throttled:
                s.category = "gpu-throttle"

    # -- findings ---------------------------------------------------------------------------

    def _findings(
        self,
        window: WindowView,
        table: pd.DataFrame,
        layout: pd.DataFrame,
        suspects: list[Suspect],
        step_ns: float,
    ) -> list[Finding]:
        if not suspects:
            self._streaks = {}
            self._recent = [*self._recent, frozenset()][-self.confirm_windows:]
            return []
        merged: dict[tuple[int, str], Suspect] = {}
        totals: dict[tuple[int, str], float] = {}
        for s in suspects:  # one finding per rank and cause, naming its costliest function
            key = (s.rank, s.category)
            totals[key] = totals.get(key, 0.0) + s.excess_ns
            if key not in merged or s.excess_ns > merged[key].excess_ns:
                merged[key] = s
        step_excess = max(self._step_excess(step_ns), sum(totals.values()))
        wait_cols = [c for c in table.columns if c[0] in WAIT_LAYERS]
        waits = table[wait_cols].sum(axis=1) if wait_cols else pd.Series(0.0, index=table.index)
        groups = Groups(layout, waits)
        larger = LargerElsewhere(totals, groups)
        coordinates = _Coordinates(layout)
        self._streaks = {key: self._streaks.get(key, 0) + 1 for key in merged}
        seen_in = self._seen_in(frozenset(merged))
        findings = []
        for (key, s), waiting in zip(merged.items(), _victims(groups, merged, totals),
                                     strict=True):
            excess = totals[key]
            # Stragglers on different ranks overlap (every rank waits for the slowest in the
            # same collectives), so a smaller second fault barely moves the step while the
            # first is there, and would never reach the alert threshold as a share of the
            # whole excess. Its share is of what the larger suspects elsewhere leave, unless
            # it is their echo: the other end of a slow link (its pipeline neighbour's).
            larger_elsewhere = larger.than(s.rank, s.category, excess)
            # The smaller causes named on the same rank are the same straggler's (its late
            # pipeline sends beside its GC pauses): they count with its largest, not against
            # it, where the largest is itself a cost worth a share (a few % of the step): a
            # healthy rank's wobbles must not add up to one.
            own = excess
            if excess >= self.excess_floor_frac * step_ns:
                own += larger.smaller_here(s.rank, excess)
            share = min(1.0, own / max(step_excess - larger_elsewhere,
                                       self._excess_floor(s, step_ns)))
            score = self._confidence(s.z) * share
            if seen_in[key] < self.confirm_windows:
                score = min(score, UNCONFIRMED_SCORE_CAP)
            ranks = list(s.ranks) or [s.rank]
            if (s.category == "cpu-contention" and not waiting and not groups.waits.empty
                    and len(groups.ranks) > 1):
                score = min(score, UNFELT_CONTENTION_SCORE_CAP)
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
                    victims=waiting,
                    pp_stage=s.pp_stage,
                    layer=s.layer,
                    function=s.name,
                    category=s.category,
                    score=round(score, 4),
                    evidence=evidence,
                    message=_message(s, coordinates, excess, share, len(waiting)),
                )
            )
        findings.sort(key=lambda f: f.score, reverse=True)
        return findings

    def _seen_in(self, suspects: frozenset[tuple[int, str]]) -> dict[tuple[int, str], int]:
        """In how many of the last ``confirm_windows + 1`` windows, this one included, each of
        this window's suspects (rank, cause) was seen; remembers this window's."""
        seen = {key: 1 + sum(key in keys for keys in self._recent) for key in suspects}
        self._recent = [*self._recent, suspects][-self.confirm_windows:]
        return seen

    def _confidence(self, z: float) -> float:
        """MIN_CONFIDENCE at z_min, rising linearly to 1 at z_full, clipped to that range
        (np.clip's result, without numpy per finding)."""
        rise = (1.0 - MIN_CONFIDENCE) * (z - self.z_min) / (self.z_full - self.z_min)
        return min(max(MIN_CONFIDENCE + rise, MIN_CONFIDENCE), 1.0)

    def _excess_floor(self, s: Suspect, step_ns: float) -> float:
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


def _victims(groups: Groups, merged: dict[tuple[int, str], Suspect],
             totals: dict[tuple[int, str], float]) -> list[list[int]]:
    """Each merged suspect's victims, all searched for together (thousands a window)."""
    return victims_many(groups, [(list(s.ranks) or [s.rank], totals[key],
                                  s.category == "network") for key, s in merged.items()])

class _Coordinates:
    """Each rank's place in the layout as a message writes it, `` (dp D, stage S, tp T)``: a
    dict lookup per finding, where pandas' row lookup cost more than the rest of the message.
    The values are those of the layout's row (its common dtype: ``3.0`` where a NaN made the
    column float)."""

    def __init__(self, layout: pd.DataFrame) -> None:
        self._position = {int(r): i for i, r in enumerate(layout.index.tolist())}
        rows = layout.to_numpy()  # the dtype a row of the layout has
        self._columns = [rows[:, layout.columns.get_loc(c)]
                         for c in ("dp_rank", "pp_stage", "tp_rank")]

    def of(self, rank: int) -> str:
        i = self._position.get(rank)
        if i is None:
            return ""
        dp, stage, tp = (c[i] for c in self._columns)
        return f" (dp {dp}, stage {stage}, tp {tp})"


def _message(s: Suspect, coordinates: _Coordinates, excess: float, share: float,
             victims: int) -> str:
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
        who = f"rank {s.rank}{coordinates.of(s.rank)}"
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
