"""Step-time detection from step records: job slowdowns, hung ranks, sequence imbalance.

- *Slowdown*: the job's median step time against its own recent history. A job-level symptom:
  it says *that* the job got slower; the peer detector says who and why. The bar is the larger
  of ``slowdown_frac`` and three times the job's own window-to-window spread, at least
  ``min_slowdown_ns``, and the slowdown must hold for ``confirm_windows`` windows in a row: a
  job whose steps always wobble by 15% has not slowed down when one window is 12% slower.
- *Hang*: a rank that reported no step in a window while its peers kept stepping.
- *Sequence imbalance*: data-parallel replicas get very different token counts in the same step,
  so the replica with the longest sequences sets the pace and the others wait — no rank is slow,
  the batches are uneven. Seen as a high spread of tokens across ranks within steps.
"""

from __future__ import annotations

import numpy as np

from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView


class StepTimeDetector:
    name = "step-time"

    def __init__(
        self,
        slowdown_frac: float = 0.10,
        full_slowdown_frac: float = 0.20,
        token_cv: float = 0.05,
        history_windows: int = 8,
        min_slowdown_ns: float = 5e6,
        confirm_windows: int = 2,
    ) -> None:
        self.slowdown_frac = slowdown_frac
        self.min_slowdown_ns = min_slowdown_ns
        self.confirm_windows = confirm_windows
        self._slow_streak = 0
        self.full_slowdown_frac = full_slowdown_frac
        self.token_cv = token_cv
        self.history_windows = history_windows
        self._medians: list[float] = []

    def detect(self, window: WindowView) -> list[Finding]:
        steps = window.steps
        if steps.empty:
            return []
        findings = [*self._hangs(window), *self._seq_imbalance(window)]
        median = float(steps["duration_ns"].median())
        if len(self._medians) >= 3:
            baseline = float(np.median(self._medians))
            spread = float(np.median(np.abs(np.array(self._medians) - baseline))) / baseline
            frac = median / baseline - 1.0
            slow = (
                frac >= max(self.slowdown_frac, 3 * 1.4826 * spread)
                and median - baseline >= self.min_slowdown_ns
            )
            self._slow_streak = self._slow_streak + 1 if slow else 0
            if self._slow_streak >= self.confirm_windows:
                findings.append(
                    window.finding(
                        self.name,
                        category="slowdown",
                        score=round(min(1.0, frac / self.full_slowdown_frac) * 0.5 + 0.25, 4),
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
        if window.topology is None or not window.topology.workers:
            return []
        counts = window.steps.groupby("rank").size()
        if counts.median() < 2:
            return []  # too few steps per window to call a missing one a hang
        silent = sorted({w.rank for w in window.topology.workers} - set(counts.index))
        if not silent or len(silent) > len(window.topology.workers) // 2:
            return []
        return [
            window.finding(
                self.name,
                rank=silent[0],
                ranks=silent,
                category="hang",
                score=1.0,
                evidence={"silent_ranks": float(len(silent)), "peer_steps": float(counts.median())},
                message=(
                    f"hang: {len(silent)} rank(s) reported no step while peers ran "
                    f"{counts.median():.0f}: {', '.join(map(str, silent[:8]))}"
                ),
            )
        ]

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
        share = min(1.0, waste / (waste + 1.0) / 0.2)
        score = round(min(1.0, cv / (2 * self.token_cv)) * share, 4)
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
