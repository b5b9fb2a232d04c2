"""The pieces of the stream job's delivery: commit positions, re-send detection, watermarks per
partition, idle closing, restored windows, and rows that do not depend on arrival order."""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pandas as pd

from trainscope.engine.core import PipelineStats
from trainscope.engine.delivery import PendingOffsets, SeenBatches
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.engine.windows import WindowEngine
from trainscope.schemas import SpanBatch, StepRecord
from trainscope.schemas.codec import decode_envelope, encode_batch, encode_stamped
from trainscope.transport.bus import Message

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


def test_positions_are_those_of_every_message_kept_though_runs_are_kept_as_one() -> None:
    """Messages that feed the same windows as the one before them are kept as one entry; the
    positions are still, at every point, the earliest message per partition with a window
    not yet written (checked against every message kept, over 3,000 random messages)."""
    rng = np.random.default_rng(3)
    pending = PendingOffsets()
    closed = {"a": 0, "b": 0}
    every: dict[tuple[str, int], list[tuple[int, dict[str, int]]]] = {EVENTS: [], SLOW: []}
    next_offset = {EVENTS: 0, SLOW: 0}
    for _ in range(3000):
        source = EVENTS if rng.random() < 0.7 else SLOW
        roll = rng.random()
        windows = ({} if roll < 0.1 else
                   {"a": closed["a"] + int(rng.integers(0, 3))} if roll < 0.8 else
                   {"a": closed["a"] + 1, "b": closed["b"] + int(rng.integers(0, 2))})
        pending.add(source, next_offset[source], windows)
        every[source].append((next_offset[source], windows))
        next_offset[source] += 1
        if rng.random() < 0.05:
            closed["a" if rng.random() < 0.7 else "b"] += 1
        expected = {}
        for src, messages in every.items():
            if messages or next_offset[src]:
                waiting = [offset for offset, fed in messages
                           if any(index >= closed[job] for job, index in fed.items())]
                expected[src] = waiting[0] if waiting else next_offset[src]
        assert pending.positions(closed.__getitem__) == expected
    runs = PendingOffsets()
    for offset in range(100):  # a poll's step messages of 100 ranks, all for one window
        runs.add(EVENTS, offset, {"a": 7})
    runs.add(EVENTS, 100, {"a": 8})
    assert runs.pending() == 2


def test_a_recreated_partition_holds_every_position_until_each_delivers_again() -> None:
    pending = PendingOffsets()
    pending.add(EVENTS, 100, {})
    pending.add(SLOW, 50, {})
    pending.add(EVENTS, 0, {})  # the broker came back empty
    assert pending.positions(lambda j: 0) == {EVENTS: 1}  # SLOW's 51 is from the old log
    pending.add(SLOW, 0, {})
    assert pending.positions(lambda j: 0) == {EVENTS: 1, SLOW: 1}


def stamp_of(payload: bytes) -> tuple[int, int, int]:
    envelope = decode_envelope(payload)
    return envelope.producer_id, envelope.seq, zlib.crc32(payload)


def test_resent_batches_are_recognised_by_their_stamp_and_bytes() -> None:
    first, second = stamp_of(encode_batch([batch(0, 0)])), stamp_of(encode_batch([batch(0, 0)]))
    assert first[0] == second[0] != 0 and second[1] == first[1] + 1
    seen = SeenBatches()
    assert not seen.resent(*first)
    seen.keep(*first, {"job": 0})
    assert seen.resent(*first)  # the same bytes re-sent
    assert not seen.resent(*second)
    # A stamp damaged into an earlier batch's stamp comes with other bytes: not a re-send, and
    # keeping it does not displace the first batch's digest.
    damaged = (first[0], first[1], zlib.crc32(b"other bytes"))
    assert not seen.resent(*damaged)
    seen.keep(*damaged, {"job": 0})
    assert seen.resent(*first) and not seen.resent(*damaged)
    seen.keep(0, 5, 1, {"job": 0})  # unstamped (an older producer): never deduplicated
    assert not seen.resent(0, 5, 1)
    seen.keep(*second, {})  # fed no window: nothing of it could be merged twice
    assert not seen.resent(*second)
    for producer_id, seq in ((1 << 63, 1), (-3, 1), (5, -1), (5, 1 << 64)):
        seen.keep(producer_id, seq, 1, {"job": 0})  # a hostile stamp: taken as unstamped
        assert not seen.resent(producer_id, seq, 1)
    assert len(seen) == 1


def test_keeping_a_polls_one_job_batches_at_once_is_resent_then_keep_in_turn() -> None:
    """SeenBatches.keep_new (a poll's one-step messages) must give the verdicts and keep the
    stamps that resent() then keep() give batch by batch: re-sends, another batch under a stamp
    kept, unstamped batches (id 0) and stamps out of range included."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        one, other = SeenBatches(), SeenBatches()
        for seen in (one, other):  # stamps kept by earlier polls
            seen.keep(3, 1, 30, {"a": 4})
            seen.keep(5, 2, 52, {"b": 5})
        stamps = [(int(rng.choice([0, 3, 5, 7, 1 << 63, -1])),
                   int(rng.choice([1, 2, 3, -4, 1 << 63])), int(rng.integers(0, 4)))
                  for _ in range(int(rng.integers(1, 30)))]
        jobs = [str(rng.choice(["a", "b"])) for _ in stamps]
        newest = [int(rng.integers(3, 7)) for _ in stamps]
        expected = []
        for (producer_id, seq, digest), job_id, index in zip(stamps, jobs, newest, strict=True):
            fresh = not other.resent(producer_id, seq, digest)
            if fresh:
                other.keep(producer_id, seq, digest, {job_id: index})
            expected.append(fresh)
        assert one.keep_new(stamps, jobs, newest) == expected
        assert pickle.dumps(one) == pickle.dumps(other) and len(one) == len(other)


def test_a_stamp_is_kept_until_the_window_after_the_newest_it_fed_is_closed() -> None:
    seen = SeenBatches()
    closed = {"a": 0, "b": 0}
    seen.keep(7, 1, 11, {"a": 3})
    seen.keep(7, 2, 12, {"a": 3, "b": 5})  # one batch with records of two jobs
    seen.keep(8, 1, 13, {"b": 4})
    closed["a"] = 4  # window 3 is closed, the one after it is open
    seen.forget_closed(closed.__getitem__)
    assert seen.resent(7, 1, 11) and seen.resent(7, 2, 12)
    closed["a"] = 5
    seen.forget_closed(closed.__getitem__)
    assert not seen.resent(7, 1, 11)
    assert seen.resent(7, 2, 12)  # job b's window 5 is still open
    closed["b"] = 6
    seen.forget_closed(closed.__getitem__)
    assert not seen.resent(8, 1, 13) and seen.resent(7, 2, 12)
    closed["b"] = 7
    seen.forget_closed(closed.__getitem__)
    assert len(seen) == 0 and not seen._until and not seen._holders
    seen.keep(9, 1, 1, {"a": 9})
    seen.keep(9, 2, 2, {"b": 9})
    seen.forget_job("a")  # evicted, or another worker's now
    assert not seen.resent(9, 1, 1) and seen.resent(9, 2, 2)


def test_stamps_survive_a_checkpoint_with_the_windows_they_wait_for() -> None:
    seen = SeenBatches()
    for seq in range(1, 101):
        seen.keep(5, seq, seq * 3, {"a": seq // 10})
    seen.keep(6, 1, 99, {"a": 2, "b": 1})
    restored = pickle.loads(pickle.dumps(seen))
    assert restored._digests == seen._digests and restored._until == seen._until
    assert restored._holders == seen._holders == {(6, 1): 2}
    closed = {"a": 6, "b": 3}
    for kept in (seen, restored):
        kept.forget_closed(closed.__getitem__)
    assert restored._digests == seen._digests and len(seen) == 51  # seqs 50 to 100
    assert len(restored) == 51 == sum(len(d) for d in seen._digests.values())
    assert restored.resent(5, 50, 150) and not restored.resent(5, 49, 147)
    assert not restored.resent(6, 1, 99)


T0_NS = 1_767_225_600 * S  # 2026-01-01


def messages_of_producers(
    ranks: int, windows: int, *, resend_every: int = 0, resend_late_every: int = 0,
    producer_lifetime_windows: int = 10,
) -> tuple[list[list[Message]], int, int]:
    """Per poll, the messages of ``ranks`` producers (one per rank, each rank's producer
    replaced every ``producer_lifetime_windows``: processes that come and go), two span
    batches per rank per window. Every ``resend_every``-th message is sent again at once;
    every ``resend_late_every``-th three windows later, when the windows it fed are closed.
    Returns the polls and how many batches were sent again at once and later."""
    polls: list[list[Message]] = []
    offset = 0
    late: dict[int, list[bytes]] = {}
    sent = at_once = later = 0
    for half in range(2 * windows):
        poll: list[Message] = []
        for payload in late.pop(half, []):
            poll.append(Message("events", 0, offset, None, payload))
            offset += 1
            later += 1
        for rank in range(ranks):
            generation = half // (2 * producer_lifetime_windows)
            producer_id = 1 + rank + 1000 * generation
            payload = encode_stamped([batch(rank, T0_NS + half * S // 2, n=5, seed=half)],
                                     producer_id,
                                     half + 1)
            sent += 1
            copies = 2 if resend_every and sent % resend_every == 0 else 1
            at_once += copies - 1
            for _ in range(copies):
                poll.append(Message("events", 0, offset, None, payload))
                offset += 1
            if resend_late_every and sent % resend_late_every == 0:
                late.setdefault(half + 6, []).append(payload)
        polls.append(poll)
    return polls, at_once, later


def test_the_stream_job_keeps_stamps_only_for_open_windows_and_merges_no_batch_twice() -> None:
    """Producers that come and go over 60 windows, some batches re-sent at once and some three
    windows later: the stamps held stay within the open windows' batches, a re-send within
    them is dropped as a duplicate, a later one is counted late, and no window holds a row
    twice (the same totals as without re-sends)."""

    def run(polls: list[list[Message]], checkpoint_at: int = -1
            ) -> tuple[dict[int, int], int, PipelineStats]:
        totals: dict[int, int] = {}
        job = EmbeddedStreamJob(detectors=[], window_s=1.0, lateness_s=0.0,
                                on_window=lambda v, _: totals.__setitem__(
                                    v.window_start_ns, int(v.summaries["count"].sum())))
        most = 0
        for i, poll in enumerate(polls):
            job.process_messages(poll)
            most = max(most, len(job.seen))
            assert job.stats().stamps_kept == len(job.seen) == sum(
                len(d) for d in job.seen._digests.values())
            if i == checkpoint_at:  # a restart from a checkpoint keeps what was kept
                job.seen = pickle.loads(pickle.dumps(job.seen))
        job.finish()
        return totals, most, job.stats()

    ranks = 40
    clean, most_clean, _ = run(messages_of_producers(ranks, 60)[0])
    polls, at_once, later = messages_of_producers(ranks, 60, resend_every=5,
                                                  resend_late_every=7)
    totals, most, stats = run(polls, checkpoint_at=61)
    assert totals == clean and len(totals) == 60
    assert stats.duplicate_batches == at_once == 960
    assert stats.window.dropped == 5 * later and later > 600  # each of its 5 rows late
    # At most the batches of the windows still open or just closed: 3 windows of 2 per rank,
    # never the 4,800 sent.
    assert most_clean <= 3 * 2 * ranks and most <= 3 * 2 * ranks


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
