"""Which findings make the stream job ask for a profile, of which ranks, and how often."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from trainscope.loop.policy import MAX_COVER_STEPS, ProfilePolicy, cover_steps
from trainscope.schemas.records import Finding, Topology, WorkerInfo
from trainscope.schemas.window import WindowView

T0 = 1_767_225_600 * 10**9


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _view(job: str = "j", world: int = 4, pp: int = 1) -> WindowView:
    dp = world // pp
    workers = [WorkerInfo(rank=r, dp_rank=r % dp, pp_stage=r // dp) for r in range(world)]
    return WindowView(job_id=job, window_start_ns=T0, window_end_ns=T0 + 10**9,
                      topology=Topology(job_id=job, dp_size=dp, pp_size=pp, workers=workers))


def _finding(rank: int, score: float = 0.9, category: str = "gpu-compute", job: str = "j",
             victims: tuple[int, ...] = ()) -> Finding:
    return Finding(job_id=job, window_start_ns=T0, window_end_ns=T0 + 10**9, detector="d",
                   rank=rank, category=category, score=score, victims=list(victims), message="m")


def test_an_alert_on_a_rank_asks_for_it_and_a_healthy_peer_of_its_stage() -> None:
    policy = ProfilePolicy(clock=Clock())
    # 8 ranks, 2 stages of 4: rank 5 is slow, ranks 4 and 6 wait on it.
    (plan,) = policy.decide(_view(world=8, pp=2), [_finding(5, victims=(4, 6))], pending=0)
    assert (plan.suspect, plan.peer) == (5, 7)  # same stage, not named by any alert


def test_nothing_below_the_threshold_without_a_rank_or_for_a_hang() -> None:
    policy = ProfilePolicy(clock=Clock())
    quiet = [_finding(1, score=0.49), _finding(-1, score=0.9), _finding(2, category="hang")]
    assert policy.decide(_view(), quiet, pending=0) == []
    assert policy.decide(_view(), [], pending=0) == []
    assert policy.counts.planned == 0


def test_one_request_per_job_and_rank_every_n_seconds() -> None:
    clock = Clock()
    policy = ProfilePolicy(every_s=600, clock=clock)
    assert len(policy.decide(_view(), [_finding(1)], pending=0)) == 1
    clock.now_s = 599
    assert policy.decide(_view(), [_finding(1)], pending=0) == []
    assert policy.counts.skipped_rate == 1
    # Another rank, or the same rank of another job, is not held back.
    assert len(policy.decide(_view(), [_finding(2)], pending=0)) == 1
    assert len(policy.decide(_view("k"), [_finding(1, job="k")], pending=0)) == 1
    clock.now_s = 600
    assert len(policy.decide(_view(), [_finding(1)], pending=0)) == 1


def test_the_fleet_budget_caps_sessions_awaited() -> None:
    policy = ProfilePolicy(max_pending=2, clock=Clock())
    plans = policy.decide(_view(world=8), [_finding(1, 0.7), _finding(3, 0.95), _finding(5, 0.8)],
                          pending=1)
    assert [p.suspect for p in plans] == [3]  # the strongest first, then the budget is spent
    assert policy.counts.skipped_fleet == 2


def test_the_strongest_finding_of_a_rank_is_the_one_profiled() -> None:
    policy = ProfilePolicy(clock=Clock())
    (plan,) = policy.decide(_view(), [_finding(1, 0.6), _finding(1, 0.8, "dataloader")],
                            pending=0)
    assert plan.finding.category == "dataloader"


def test_a_job_of_one_rank_has_no_peer() -> None:
    policy = ProfilePolicy(clock=Clock())
    assert policy.decide(_view(world=1), [_finding(0)], pending=0) == []
    assert policy.counts.skipped_no_peer == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        ProfilePolicy(max_pending=0)


def _steps(durations_ms: dict[int, list[float]]) -> pd.DataFrame:
    rows = [(rank, step, T0 + step * 10**8, int(ms * 1e6))
            for rank, steps in durations_ms.items() for step, ms in enumerate(steps)]
    return pd.DataFrame(rows, columns=["rank", "step", "start_ns", "duration_ns"])


def test_a_straggler_slow_now_and_then_is_profiled_long_enough_to_catch_it() -> None:
    """A 1-s stop every 20 steps: 5 profiled steps between two stops find nothing; the plan
    asks for enough steps to hold two of them, up to the cap."""
    every_20th = [1050.0 if step % 20 == 7 else 50.0 for step in range(40)]
    assert cover_steps(_steps({2: every_20th, 1: [90.0] * 40}), 2) == 40
    assert cover_steps(_steps({2: every_20th[:20]}), 2) == 40  # one stop in the window
    one_in_40 = [1050.0 if step == 7 else 50.0 for step in range(40)]
    assert cover_steps(_steps({2: one_in_40}), 2) == MAX_COVER_STEPS  # 80 would do
    # Steady steps (or slow ones throughout): any profile holds them.
    assert cover_steps(_steps({2: [50.0] * 40}), 2) == 0
    assert cover_steps(_steps({2: [50.0] * 40}), 3) == 0
    view = dataclasses.replace(_view(), steps=_steps({r: every_20th for r in range(4)}))
    (plan,) = ProfilePolicy(clock=Clock()).decide(view, [_finding(2, category="host")], 0)
    assert (plan.suspect, plan.cover_steps) == (2, 40)
