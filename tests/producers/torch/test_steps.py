"""The step log: the training thread appends integers, the sender thread builds the records."""

from __future__ import annotations

from trainscope.producers.torch import steps as steps_module
from trainscope.producers.torch.steps import StepTracker
from trainscope.schemas.records import StepRecord


def test_steps_are_drained_as_records_in_order_with_their_figures() -> None:
    tracker = StepTracker("job", 3)
    tracker.activity(1_000)
    tracker.samples += 8  # as the forward's start adds them
    tracker.tokens += 512
    assert tracker.end(1_500) == 0
    assert tracker.end(2_700, samples=4, tokens=0) == 1  # an explicit step's own counts
    assert tracker.end(2_600) == 2  # a clock that stepped back: no negative duration
    assert tracker.log.pending() == 3
    (batch,) = tracker.drain()
    assert batch.to_records() == [
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
    assert [r.step for b in tracker.drain() for r in b.to_records()] == [5]


def test_collective_time_goes_into_its_step_and_a_stall_is_reported_as_it_lasts() -> None:
    ms = 1_000_000
    tracker = StepTracker("job", 1)
    tracker.activity(0)
    for step in range(10):
        tracker.collective_ns += 3 * ms  # what the collective hooks add during the step
        tracker.end((step + 1) * 10 * ms)
    records = [r for b in tracker.drain() for r in b.to_records()]
    assert {r.collective_ns for r in records} == {3 * ms}
    start = tracker.start_ns
    # A step open for 1 s (100 recent steps) but under STALL_MIN_S: nothing to report.
    assert tracker.stall_report(start + 1_000 * ms, "h") == []
    # Open 4 s, waiting in a collective issued 1 s in: both figures, in seconds.
    tracker.pending[7] = start + 1_000 * ms
    report = tracker.stall_report(start + 4_000 * ms, "h")
    assert [(s.name, s.value, s.rank, s.host) for s in report] == [
        ("step_open_s", 4.0, 1, "h"), ("collective_wait_s", 3.0, 1, "h")]
    # The collective completed, the rank is busy in its own code: waiting 0.
    del tracker.pending[7]
    assert [s.value for s in tracker.stall_report(start + 5_000 * ms, "h")] == [5.0, 0.0]
