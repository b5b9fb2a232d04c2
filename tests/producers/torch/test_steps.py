"""The step log: the training thread appends integers, the sender thread builds the records."""

from __future__ import annotations

from trainscope.producers.torch import steps as steps_module
from trainscope.producers.torch.steps import StepTracker
from trainscope.schemas.records import StepRecord


def test_steps_are_drained_as_records_in_order_with_their_figures() -> None:
    tracker = StepTracker("job", 3)
    tracker.activity(1_000)
    tracker.add_samples(8, 512)
    assert tracker.end(1_500) == 0
    assert tracker.end(2_700, samples=4, tokens=0) == 1  # an explicit step's own counts
    assert tracker.end(2_600) == 2  # a clock that stepped back: no negative duration
    assert tracker.log.pending() == 3
    assert tracker.drain() == [
        StepRecord(job_id="job", rank=3, step=0, start_ns=1_000, duration_ns=500, samples=8,
                   tokens=512),
        StepRecord(job_id="job", rank=3, step=1, start_ns=1_500, duration_ns=1_200, samples=4),
        StepRecord(job_id="job", rank=3, step=2, start_ns=2_700, duration_ns=0),
    ]
    assert tracker.drain() == [] and tracker.log.pending() == 0


def test_a_log_nobody_drains_is_cleared_and_counted(monkeypatch) -> None:
    monkeypatch.setattr(steps_module, "MAX_PENDING_STEPS", 4)
    tracker = StepTracker("job", 0)
    for i in range(5):
        tracker.end(100 * (i + 1))
    tracker.log.bound()
    assert tracker.log.dropped == 5 and tracker.log.pending() == 0
    tracker.end(1_000)
    assert [r.step for r in tracker.drain()] == [5]
