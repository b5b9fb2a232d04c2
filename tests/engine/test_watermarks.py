"""A source's progress is the lower median of its active ranks' latest event times: kept as
arrays (``RankProgress``), it must agree with that definition read off every rank's history."""

from __future__ import annotations

import numpy as np
import pytest

from trainscope.engine.state import JobState, RankProgress
from trainscope.engine.watermarks import Watermarks

IDLE_S = 5.0


def reference(history: dict[int, tuple[int, float]], now_s: float) -> int | None:
    """The definition: ranks heard from within IDLE_S, lower median of their latest times;
    the newest of all when none is active."""
    if not history:
        return None
    active = sorted(ns for ns, seen_s in history.values() if now_s - seen_s < IDLE_S)
    if not active:
        return max(ns for ns, _ in history.values())
    return active[(len(active) - 1) // 2]


@pytest.mark.parametrize("seed", range(6))
def test_the_agreed_progress_is_the_lower_median_of_the_active_ranks(seed: int) -> None:
    rng = np.random.default_rng(seed)
    progress = RankProgress()
    history: dict[int, tuple[int, float]] = {}
    now_s = 0.0
    assert progress.agreed_ns(now_s, IDLE_S) is None
    for _ in range(200):
        now_s += float(rng.exponential(0.5))
        # A poll's ranks: distinct, some new, some known; event times that may go back
        # (a rank's older records re-read), which never lower its progress.
        ranks = rng.choice(300, size=int(rng.integers(1, 40)), replace=False)
        newest = rng.integers(0, 10**6, size=len(ranks)) + int(now_s * 1e5)
        progress.update(ranks, newest, now_s)
        for rank, ns in zip(ranks.tolist(), newest.tolist(), strict=True):
            known = history.get(rank)
            history[rank] = (ns if known is None else max(known[0], ns), now_s)
        for later_s in (now_s, now_s + IDLE_S / 2, now_s + 2 * IDLE_S):
            assert progress.agreed_ns(later_s, IDLE_S) == reference(history, later_s)
    assert progress.size == len(history)


def test_the_watermark_follows_the_median_rank_not_a_fast_clock() -> None:
    now = [100.0]
    marks = Watermarks(lateness_ns=0, source_idle_s=IDLE_S, clock=lambda: now[0])
    job = JobState(first_seen_s=0.0)
    ranks = np.arange(5)
    # Rank 4's clock runs 600 s ahead: the source's progress is what ranks 0-3 agree on.
    marks.observe(job, "p0", (ranks, np.array([10, 11, 12, 13, 600 * 10**9])))
    assert marks.watermark_ns(job) == 12
    marks.observe(job, "p0", (np.array([0, 1]), np.array([20, 21])))
    assert marks.watermark_ns(job) == 20  # of 12, 13, 20, 21 and rank 4's
    # All quiet past the idle time: the newest of all, so a stopped job still closes.
    now[0] += 2 * IDLE_S
    assert marks.watermark_ns(job) == 600 * 10**9
