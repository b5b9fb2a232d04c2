"""A source's progress is the lower median of its active ranks' latest event times: kept as
arrays (``RankProgress``), it must agree with that definition read off every rank's history."""

from __future__ import annotations

import pickle

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


RANKS = 6400  # the kept value is taken again once a 64th of them moved: 100


def _agreed_between_polls(progress: RankProgress, now_s: float) -> int:
    value = progress.agreed_ns(now_s, IDLE_S)
    assert value is not None
    return value


def test_what_the_ranks_agree_on_is_kept_between_polls_and_never_ahead_of_them() -> None:
    """Taken again on every poll, the median over every rank was the largest cost of a
    100,000-rank job's polls; kept between them, it may lag by a 64th of the ranks'
    deliveries, and is never ahead of the ranks (a window closes late, not early)."""
    rng = np.random.default_rng(3)
    progress = RankProgress()
    history = {r: (int(ns), 0.0) for r, ns in enumerate(rng.integers(0, 10**6, RANKS))}
    progress.update(np.arange(RANKS), np.array([ns for ns, _ in history.values()]), 0.0)
    # (deliveries so far, the true value then) after each poll
    truths: list[tuple[int, int]] = [(0, _agreed_between_polls(progress, 0.0))]
    delivered, kept = 0, 0
    for poll in range(1, 400):
        now_s = poll * 1e-3  # polls a millisecond apart: only the count of deliveries says
        ranks = rng.choice(RANKS, size=int(rng.integers(1, 30)), replace=False)
        newest = np.array([history[r][0] for r in ranks.tolist()]) + rng.integers(0, 10**5,
                                                                                   len(ranks))
        progress.update(ranks, newest, now_s)
        for rank, ns in zip(ranks.tolist(), newest.tolist(), strict=True):
            history[rank] = (ns, now_s)
        delivered += len(ranks)
        value, truth = _agreed_between_polls(progress, now_s), reference(history, now_s)
        assert truth is not None
        assert value <= truth, poll
        kept += value != truth
        # No further behind than the ranks were fewer than 100 deliveries ago.
        assert value >= min(t for d, t in truths if delivered - d < 100), poll
        truths.append((delivered, truth))
    assert kept > 100  # it was kept, not taken again on every poll
    # Half a second later it is taken again whatever moved.
    assert _agreed_between_polls(progress, 0.4 + 0.5) == reference(history, 0.4 + 0.5)


def test_a_rank_new_or_back_from_idle_takes_the_agreed_value_again_at_once() -> None:
    progress = RankProgress()
    # Ranks 6398 and 6399, silent since t=0, are idle from t=5: at t=5.1 the value is what
    # ranks 0-6397 agree on.
    progress.update(np.arange(RANKS), np.zeros(RANKS, dtype=np.int64), 0.0)
    progress.update(np.arange(RANKS - 2), np.arange(RANKS - 2) + 10_000, 4.8)
    assert _agreed_between_polls(progress, 5.1) == 10_000 + (RANKS - 3) // 2
    # Back after 5.2 s of silence, their (low) progress counts again: the value moves down,
    # though only two ranks moved and a tenth of a second passed.
    progress.update(np.array([RANKS - 2, RANKS - 1]), np.array([1, 1]), 5.2)
    assert _agreed_between_polls(progress, 5.2) == 10_000 + (RANKS - 1) // 2 - 2

    # New ranks' progress counts at once too.
    progress = RankProgress()
    progress.update(np.arange(RANKS), np.arange(RANKS) + 10_000, 0.1)
    assert _agreed_between_polls(progress, 0.1) == 10_000 + (RANKS - 1) // 2
    progress.update(np.array([RANKS, RANKS + 1]), np.array([2, 2]), 0.2)
    assert _agreed_between_polls(progress, 0.2) == 10_000 + (RANKS + 1) // 2 - 2


def test_rank_progress_survives_a_snapshot_and_forgets_what_it_kept() -> None:
    progress = RankProgress()
    progress.update(np.arange(RANKS), np.arange(RANKS), 0.0)
    assert _agreed_between_polls(progress, 0.0) == (RANKS - 1) // 2
    restored = pickle.loads(pickle.dumps(progress))
    assert restored.slots == progress.slots and restored.size == RANKS
    assert _agreed_between_polls(restored, 0.0) == (RANKS - 1) // 2
    # As an older version pickled it: its slots, as (None, slots).
    older = RankProgress.__new__(RankProgress)
    older.__setstate__((None, {"latest_ns": progress.latest_ns, "seen_s": progress.seen_s,
                               "size": RANKS, "slots": progress.slots}))
    assert _agreed_between_polls(older, 0.0) == (RANKS - 1) // 2
