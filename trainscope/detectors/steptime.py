"""Step-time detection from step records: job slowdowns, hung ranks, sequence imbalance.

- *Slowdown*: the job's median step time against its own recent history. A job-level symptom:
  it says *that* the job got slower; the peer detector says who and why. The bar is the larger
  of ``slowdown_frac`` and three times the job's own window-to-window spread, at least
  ``min_slowdown_ns``, and the slowdown must hold for ``confirm_windows`` windows in a row: a
  job whose steps always wobble by 15% has not slowed down when one window is 12% slower.
- *Hang*: a rank that reported no step in a window while its peers kept stepping, after it had
  reported steps before.
- *No data*: a declared rank that has never sent a step record in this job while its peers
  step: not a hang but a deployment problem (its producer is not running).
- *Sequence imbalance*: data-parallel replicas get very different token counts in the same step,
  so the replica with the longest sequences sets the pace and the others wait — no rank is slow,
  the batches are uneven. Seen as a high spread of tokens across ranks within steps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainscope.detectors.features import MAD_TO_SIGMA
from trainscope.detectors.params import check_number, check_order
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

DETECTOR = "step-time"
# A median over fewer past windows is not a baseline: slowdowns are judged from this many on.
MIN_HISTORY_WINDOWS = 3
# A slowdown must exceed this many of the job's own window-to-window standard deviations (the
# MAD of its past medians, scaled): a job that always wobbles by 15% is not slower at 12%.
SPREAD_SIGMAS = 3.0
# Score of a slowdown: SLOWDOWN_BASE_SCORE at the bar, rising by SLOWDOWN_SCORE_RANGE as it
# grows to full_slowdown_frac — a job-level symptom, so it tops out at 0.75 and never outranks
# a finding that says who and why.
SLOWDOWN_BASE_SCORE = 0.25
SLOWDOWN_SCORE_RANGE = 0.5
# A window whose ranks ran fewer steps than this (median) cannot tell a hang from a long step.
MIN_STEPS_FOR_HANG = 2
# At most this share of the ranks silent is a hang; more is the job stopping or a gap in the
# data, which no one rank explains.
MAX_HANG_FRAC = 0.5
# Score of a declared rank that never reported, once peers have stepped in this many windows: at
# the alert threshold, because nobody watches that rank until someone starts its producer, yet
# never above a finding that explains a slowdown. In the job's first window it stays below
# (NO_DATA_FIRST_SCORE): a rank that starts a little later than its peers is not a fault.
NO_DATA_SCORE = 0.5
NO_DATA_FIRST_SCORE = 0.45
NO_DATA_CONFIRM_WINDOWS = 2
# Sequence imbalance counts fully in the score when the longest batch's excess over the mean is
# this share of it (0.1: the other replicas idle a tenth of their compute; a lognormal spread of
# 0.2 in sequence lengths, 8 micro-batches per step, 4 replicas, wastes about 6%, a score of
# about 0.6) ...
SEQ_FULL_WASTE_FRAC = 0.1
# ... and when the spread of tokens is this many times token_cv.
SEQ_FULL_CV_FACTOR = 1.5


class StepTimeDetector:
    """Finds what the step records alone say about a job: it slowed down, a rank hangs, or the
    batches of its data-parallel replicas are uneven (the module docstring says how).

    These are job-level symptoms: a slowdown says *that* the job is slower, not who made it so
    (the peer detector says that), so its score tops out at 0.75. State, kept across windows
    and pickled with checkpoints: the job's median step time in each of its last
    ``history_windows`` windows (the baseline a slowdown is measured from), and how many
    windows in a row it has been slow.

    Parameters
    ----------
    slowdown_frac : float, default 0.1 (fraction of the baseline step)
        The job's median step this much above the median of its recent windows is a slowdown,
        if the job's own window-to-window spread allows: the bar is at least three of its
        standard deviations, so a job that always wobbles by 15% is not slower at 12%.
    full_slowdown_frac : float, default 0.2 (fraction of the baseline step)
        The slowdown at which a slowdown finding has its full score (0.25 at the bar, rising to
        0.75 here). Must be above ``slowdown_frac``.
    token_cv : float, default 0.05 (coefficient of variation)
        Tokens per step varying this much across ranks (the median over the window's steps of
        their standard deviation over their mean) is ``seq-imbalance``: below it, uneven batches
        cost less than ordinary noise. The spread counts fully in the score at twice this.
    history_windows : int, default 8 (windows)
        Past windows whose median step times form the baseline (2 minutes at 15 s windows); at
        least 3.
    min_slowdown_ns : float, default 5e6 (ns per step)
        A slowdown must also add at least this much to the median step: below 5 ms per step it
        is not actionable.
    confirm_windows : int, default 2 (windows)
        Windows in a row a slowdown must hold before it is reported.

    Examples
    --------
    Two windows of a job of 2 stages × 4 ranks: in the second, rank 3 reported no step while its
    peers ran four:

    >>> import dataclasses
    >>> from trainscope.detectors.contract import example_windows
    >>> first, second = example_windows(2)
    >>> silent = dataclasses.replace(second, steps=second.steps[second.steps["rank"] != 3])
    >>> detector = StepTimeDetector()
    >>> detector.detect(first)
    []
    >>> finding, = detector.detect(silent)
    >>> finding.category, finding.ranks, finding.score
    ('hang', [3], 1.0)
    >>> finding.message
    'hang: 1 rank(s) reported no step while peers ran 4: 3'

    Had rank 3 never sent a step, it would be no data, not a hang (score 0.45 in the job's
    first window, 0.5 from the second on):

    >>> finding, = StepTimeDetector().detect(silent)
    >>> finding.category, finding.ranks, finding.score
    ('no-data', [3], 0.45)
    """

    name = DETECTOR

    def __init__(
        self,
        slowdown_frac: float = 0.10,
        full_slowdown_frac: float = 0.20,
        token_cv: float = 0.05,
        history_windows: int = 8,
        min_slowdown_ns: float = 5e6,
        confirm_windows: int = 2,
    ) -> None:
        check_number(DETECTOR, "slowdown_frac", slowdown_frac, gt=0)
        check_number(DETECTOR, "full_slowdown_frac", full_slowdown_frac, gt=0)
        check_order(DETECTOR, "slowdown_frac", slowdown_frac,
                    "full_slowdown_frac", full_slowdown_frac)
        check_number(DETECTOR, "token_cv", token_cv, gt=0)
        check_number(DETECTOR, "history_windows", history_windows, ge=MIN_HISTORY_WINDOWS,
                     integer=True)
        check_number(DETECTOR, "min_slowdown_ns", min_slowdown_ns, ge=0)
        check_number(DETECTOR, "confirm_windows", confirm_windows, ge=1, integer=True)
        self.slowdown_frac = slowdown_frac
        self.min_slowdown_ns = min_slowdown_ns
        self.confirm_windows = confirm_windows
        self._slow_streak = 0
        self.full_slowdown_frac = full_slowdown_frac
        self.token_cv = token_cv
        self.history_windows = history_windows
        self._medians: list[float] = []
        # Ranks that ever sent a step record in this job, and windows in which any rank did:
        # a rank silent from the start is no-data, one that went silent is a hang.
        self._reported: set[int] = set()
        self._stepping_windows = 0

    def __setstate__(self, state: dict[str, object]) -> None:
        # A checkpoint written before a field existed restores with that field's default.
        self.__dict__.update({**StepTimeDetector().__dict__, **state})

    def detect(self, window: WindowView) -> list[Finding]:
        steps = window.steps
        if steps.empty:
            return []
        findings = [*self._hangs(window), *self._seq_imbalance(window)]
        median = float(steps["duration_ns"].median())
        if len(self._medians) >= MIN_HISTORY_WINDOWS:
            baseline = float(np.median(self._medians))
            spread = float(np.median(np.abs(np.array(self._medians) - baseline))) / baseline
            frac = median / baseline - 1.0
            slow = (
                frac >= max(self.slowdown_frac, SPREAD_SIGMAS * MAD_TO_SIGMA * spread)
                and median - baseline >= self.min_slowdown_ns
            )
            self._slow_streak = self._slow_streak + 1 if slow else 0
            if self._slow_streak >= self.confirm_windows:
                findings.append(
                    window.finding(
                        self.name,
                        category="slowdown",
                        score=round(SLOWDOWN_BASE_SCORE + SLOWDOWN_SCORE_RANGE
                                    * min(1.0, frac / self.full_slowdown_frac), 4),
                        evidence={"step_ns": median, "baseline_step_ns": baseline, "frac": frac,
                                  "baseline_spread_frac": spread},
                        message=(
                            f"slowdown: median step time {median / 1e6:.0f} ms is {frac:.0%} "
                            f"above the recent {baseline / 1e6:.0f} ms"
                        ),
                    )
                )
        self._medians = [*self._medians, median][-self.history_windows :]
        return findings

    def _hangs(self, window: WindowView) -> list[Finding]:
        """A hang for declared ranks that reported before and stepped no more while their peers
        did; no-data for declared ranks that never reported (the step records tell both)."""
        counts = window.steps.groupby("rank").size()
        self._stepping_windows += 1
        known = self._reported
        self._reported = known | {int(r) for r in counts.index}
        if window.topology is None or not window.topology.workers:
            return []
        silent = {w.rank for w in window.topology.workers} - set(counts.index)
        never = sorted(silent - known)
        findings = [self._no_data(window, never, counts)] if never else []
        went_silent = sorted(silent & known)
        if counts.median() < MIN_STEPS_FOR_HANG:
            return findings  # too few steps per window to call a missing one a hang
        if not went_silent or len(went_silent) > MAX_HANG_FRAC * len(known):
            return findings
        findings.append(
            window.finding(
                self.name,
                rank=went_silent[0],
                ranks=went_silent,
                category="hang",
                score=1.0,
                evidence={"silent_ranks": float(len(went_silent)),
                          "peer_steps": float(counts.median())},
                message=(
                    f"hang: {len(went_silent)} rank(s) reported no step while peers ran "
                    f"{counts.median():.0f}: {', '.join(map(str, went_silent[:8]))}"
                ),
            )
        )
        return findings

    def _no_data(self, window: WindowView, never: list[int], counts: pd.Series) -> Finding:
        first = self._stepping_windows < NO_DATA_CONFIRM_WINDOWS
        shown = ", ".join(map(str, never[:8])) + (", …" if len(never) > 8 else "")
        return window.finding(
            self.name,
            rank=never[0],
            ranks=never,
            category="no-data",
            score=NO_DATA_FIRST_SCORE if first else NO_DATA_SCORE,
            evidence={"silent_ranks": float(len(never)), "reporting_ranks": float(len(counts)),
                      "peer_steps": float(counts.median())},
            message=(
                f"no-data: {len(never)} declared rank(s) never sent a step record while "
                f"{len(counts)} peer(s) ran {counts.median():.0f} step(s): {shown}; the producer "
                "on those ranks never reported (check that attach() or the agent runs there)"
            ),
        )

    def _seq_imbalance(self, window: WindowView) -> list[Finding]:
        steps = window.steps[window.steps["tokens"] > 0]
        if steps.empty:
            return []
        per_step = steps.groupby("step")["tokens"]
        counts = per_step.size()
        stats = per_step.agg(["mean", "std", "max"])[counts >= 2]
        if stats.empty:
            return []
        cv = float((stats["std"] / stats["mean"]).median())
        if cv < self.token_cv:
            return []
        # The slowest replica sets the pace: its token excess over the mean is the waste.
        waste = float((stats["max"] / stats["mean"] - 1.0).mean())
        share = min(1.0, waste / (waste + 1.0) / SEQ_FULL_WASTE_FRAC)
        score = round(min(1.0, cv / (SEQ_FULL_CV_FACTOR * self.token_cv)) * share, 4)
        return [
            window.finding(
                self.name,
                category="seq-imbalance",
                score=score,
                evidence={"token_cv": cv, "max_over_mean": 1.0 + waste},
                message=(
                    f"seq-imbalance: tokens per step vary {cv:.0%} across ranks; the longest "
                    f"batch is {waste:.0%} above the mean, so the other ranks wait"
                ),
            )
        ]
