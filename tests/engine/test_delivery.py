"""The pieces of the stream job's delivery: commit positions, re-send detection, watermarks per
partition, idle closing, restored windows, and rows that do not depend on arrival order."""

from __future__ import annotations

import zlib

import numpy as np
import pandas as pd

from trainscope.engine.delivery import PendingOffsets, SeenBatches
from trainscope.engine.windows import WindowEngine
from trainscope.schemas import SpanBatch, StepRecord
from trainscope.schemas.codec import decode_envelope, encode_batch

S = 10**9
EVENTS = ("events", 0)
SLOW = ("events", 1)


def batch(rank: int, t0_ns: int, n: int = 50, seed: int = 0, job_id: str = "job") -> SpanBatch:
    rng = np.random.default_rng(seed)
    return SpanBatch.from_arrays(
        job_id=job_id, layers=["torch_op", "gc"], names=["forward", "gc.collect"],
        rank=np.full(n, rank), fn=rng.integers(0, 2, n), step=np.zeros(n),
        start_ns=t0_ns + rng.integers(0, S // 2, n),
        duration_ns=rng.integers(1_000, 50_000_000, n), bytes_moved=rng.integers(0, 9, n),
    )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_commit_position_is_the_earliest_message_of_an_unwritten_window() -> None:
    pending = PendingOffsets()
    pending.add(EVENTS, 10, {"job": 0})
    pending.add(EVENTS, 11, {"job": 1})
    pending.add(EVENTS, 12, {})  # a duplicate, or late: fed nothing
    pending.add(SLOW, 40, {"job": 0})
    closed = {"job": 0}
    assert pending.positions(lambda j: closed[j]) == {EVENTS: 10, SLOW: 40}
    closed["job"] = 1  # window 0 closed and written
    assert pending.positions(lambda j: closed[j]) == {EVENTS: 11, SLOW: 41}
    closed["job"] = 2
    assert pending.positions(lambda j: closed[j]) == {EVENTS: 13, SLOW: 41}
    assert pending.pending() == 0


def test_a_recreated_partition_holds_every_position_until_each_delivers_again() -> None:
    pending = PendingOffsets()
    pending.add(EVENTS, 100, {})
    pending.add(SLOW, 50, {})
    pending.add(EVENTS, 0, {})  # the broker came back empty
    assert pending.positions(lambda j: 0) == {EVENTS: 1}  # SLOW's 51 is from the old log
    pending.add(SLOW, 0, {})
    assert pending.positions(lambda j: 0) == {EVENTS: 1, SLOW: 1}


def test_resent_batches_are_recognised_by_their_stamp() -> None:
    payload = encode_batch([batch(0, 0)])
    again = encode_batch([batch(0, 0)])
    first, second = decode_envelope(payload), decode_envelope(again)
    assert first.producer_id == second.producer_id != 0
    assert second.seq == first.seq + 1
    seen = SeenBatches(horizon=4)
    assert seen.first_time(first.producer_id, first.seq)
    assert not seen.first_time(first.producer_id, first.seq)  # the same bytes re-sent
    assert seen.first_time(second.producer_id, second.seq)
    assert seen.first_time(0, 0) and seen.first_time(0, 0)  # unstamped: never deduplicated
    # A stamp damaged into an earlier batch's stamp comes with other bytes: not a re-send.
    digest = zlib.crc32(payload)
    assert seen.first_time(first.producer_id, 10, digest)
    assert not seen.first_time(first.producer_id, 10, digest)
    assert seen.first_time(first.producer_id, 10, zlib.crc32(b"other bytes"))
    for seq in range(100, 120):  # memory stays bounded
        seen.first_time(7, seq)
    assert len(seen._seen[7]) <= 8


def test_a_slow_partition_delays_windows_instead_of_making_its_events_late() -> None:
    clock = Clock()
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.0, source_idle_s=5.0, clock=clock)
    engine.expect_sources([EVENTS, SLOW])
    engine.add_spans([batch(0, 0)], EVENTS)
    engine.add_spans([batch(0, 1 * S)], EVENTS)
    assert engine.close_ready() == []  # SLOW is assigned and has not delivered yet
    engine.add_spans([batch(1, 0)], SLOW)
    engine.add_spans([batch(0, 5 * S)], EVENTS)
    assert engine.close_ready() == []  # SLOW is at 0.5 s: window 0 waits for it
    engine.add_spans([batch(1, 1 * S)], SLOW)
    engine.add_spans([batch(1, 3 * S)], SLOW)
    closed = engine.close_ready()
    assert [v.window_start_ns for v in closed] == [0, S]
    assert sorted(closed[0].summaries["rank"].unique()) == [0, 1]
    assert engine.stats.late_events == 0
    # SLOW goes quiet (its ranks hung, or it is caught up): after source_idle_s of
    # processing time it stops holding the job's windows.
    clock.now += 6.0
    engine.add_spans([batch(0, 9 * S)], EVENTS)
    assert [v.window_start_ns for v in engine.close_ready()] == [3 * S, 5 * S]


def test_a_new_jobs_windows_wait_for_busy_sources_that_have_not_delivered_it_yet() -> None:
    """The race the Faust contract test hit: a job's metrics, far ahead, came first through one
    partition; its spans were still on the way through partitions busy with another job's. Its
    windows must wait for them, not close and turn them late."""
    clock = Clock()
    metrics = ("metrics", 0)
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.0, source_idle_s=5.0, clock=clock)
    engine.expect_sources([EVENTS, SLOW, metrics])
    engine.add_spans([batch(0, 0, job_id="other")], EVENTS)
    engine.add_spans([batch(1, 0, job_id="other")], SLOW)
    engine.add_spans([batch(0, 9 * S)], metrics)  # stands for the job's first, far-ahead record
    assert [v.job_id for v in engine.close_ready()] == []
    clock.now += 1.0
    engine.add_spans([batch(0, 0), batch(0, 2 * S)], EVENTS)
    engine.add_spans([batch(1, 0), batch(1, 3 * S)], SLOW)
    assert engine.stats.late_events == 0
    closed = [v for v in engine.close_ready() if v.job_id == "job"]
    assert [v.window_start_ns for v in closed] == [0]  # the slowest source is at 2.5 s
    assert sorted(closed[0].summaries["rank"].unique()) == [0, 1]
    # A busy source that never carries the job holds its windows for source_idle_s only.
    lone = WindowEngine(window_s=1.0, allowed_lateness_s=0.0, source_idle_s=5.0, clock=clock)
    lone.add_spans([batch(0, 0, job_id="other")], EVENTS)
    lone.add_spans([batch(0, 0), batch(0, 3 * S)], SLOW)
    assert lone.close_ready() == []
    clock.now += 5.0
    lone.add_spans([batch(0, 4 * S, job_id="other")], EVENTS)  # EVENTS stays busy
    assert [v.window_start_ns for v in lone.close_ready() if v.job_id == "job"] == [0]


def test_a_job_that_stops_sending_has_its_windows_closed() -> None:
    clock = Clock()
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=5.0, clock=clock)
    engine.add_spans([batch(0, 0), batch(1, S)])
    assert engine.close_ready() == [] and engine.close_idle(30.0) == []
    clock.now += 31.0
    assert [v.window_start_ns for v in engine.close_idle(30.0)] == [0, S]
    assert engine.open_windows() == 0


def test_records_of_windows_written_before_a_restart_are_skipped_not_late() -> None:
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.0)
    engine.restore_closed("job", 2 * S)
    engine.add_spans([batch(0, 0), batch(0, 2 * S)])
    engine.add_steps([StepRecord(job_id="job", rank=0, step=0, start_ns=S, duration_ns=10)])
    assert engine.stats.replayed == 51 and engine.stats.late_events == 0
    assert [v.window_start_ns for v in engine.close_all()] == [2 * S]


def rows(views: list) -> pd.DataFrame:
    return pd.concat([v.summaries.assign(w=v.window_start_ns) for v in views], ignore_index=True)


def test_window_rows_do_not_depend_on_arrival_order_or_poll_grouping() -> None:
    batches = [batch(r % 4, (i // 4) * S // 3, n=200, seed=i) for i, r in enumerate(range(24))]
    in_order = WindowEngine(window_s=1.0, allowed_lateness_s=60.0)
    in_order.add_spans(batches)
    shuffled = WindowEngine(window_s=1.0, allowed_lateness_s=60.0)
    order = np.random.default_rng(3).permutation(len(batches))
    for chunk in np.array_split(order, 5):  # other polls, other order, other sources
        shuffled.add_spans([batches[i] for i in chunk], source=int(chunk[0]) % 3)
    a, b = rows(in_order.close_all()), rows(shuffled.close_all())
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    assert (a["m2_ns2"] > 0).all()
