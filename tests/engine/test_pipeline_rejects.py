"""Inputs that used to crash or perturb the pipeline are set aside whole, with a reason."""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest

from trainscope.engine.bus_job import BusStreamJob
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import FunctionSummary, MetricSample, SpanBatch, StepRecord
from trainscope.sinks.clickhouse import ClickHouseSink, run_query
from trainscope.transport.bus import DEAD_LETTER_TOPIC, EVENTS_TOPIC, Message
from trainscope.transport.memory import MemoryBus

T0 = 1_767_225_600 * 10**9


def spans(job: str, start_ns: int, ranks: tuple[int, ...] = (0, 1)) -> SpanBatch:
    n = len(ranks)
    return SpanBatch.from_arrays(job_id=job, layers=["torch_op"], names=["forward"],
                                 rank=list(ranks), fn=[0] * n, step=[0] * n,
                                 start_ns=[start_ns] * n, duration_ns=[1000] * n)


@pytest.fixture
def sink(tmp_path):
    sink = ClickHouseSink.open(tmp_path / "store")
    yield sink
    sink.close()


def dead_letters(sink: ClickHouseSink) -> list[tuple]:
    return run_query(sink.client, "SELECT topic, partition, offset, error FROM dead_letters "
                                  "ORDER BY offset")[1]


def test_the_reported_crashers_are_dead_lettered_and_the_stream_goes_on(sink) -> None:
    bus = MemoryBus(partitions=1)
    pipeline = BusStreamJob(bus, detectors=[], window_s=5.0, sink=sink)
    summary = FunctionSummary(job_id="z", rank=0, layer="gc", name="gc.collect",
                              window_start_ns=T0, window_end_ns=T0 + 5 * 10**9, count=1,
                              total_ns=5, min_ns=5, max_ns=5)
    bad = [
        bytes.fromhex("8101a1fa"),
        encode_batch([StepRecord(job_id="a", rank=2**40, step=0, start_ns=T0, duration_ns=1)]),
        encode_batch([MetricSample(job_id="a", rank=2**27, ts_ns=T0, name="x", value=1.0)]),
        encode_batch([spans("z", 0)]),
    ]
    for payload in bad:
        bus.publish(EVENTS_TOPIC, payload)
    bus.publish(EVENTS_TOPIC, encode_batch([summary]))  # after a span at 0: overflowed a shift
    bus.publish(EVENTS_TOPIC, encode_batch([spans("a", T0), spans("a", T0 + 6 * 10**9)]))
    started = time.perf_counter()
    while pipeline.poll_once(timeout_s=0.0):
        pass
    assert time.perf_counter() - started < 2.0  # no 1.2 GB array for rank 2**27
    pipeline.finish()

    stats = pipeline.stats()
    assert (stats.decode.received, stats.decode.emitted, stats.decode.rejected) == (6, 2, 4)
    assert bus.message_count(DEAD_LETTER_TOPIC) == 4
    rows = dead_letters(sink)
    assert [offset for _, _, offset, _ in rows] == [0, 1, 2, 3]
    errors = [error for _, _, _, error in rows]
    assert errors[0] == f"{EVENTS_TOPIC}[0]@0: Expected `str`, got `int` - at `key` in `$`"
    assert errors[1] == (f"{EVENTS_TOPIC}[0]@1: records[0] (step): rank=1099511627776 not in "
                         "[0, 131071], no topology known for job 'a'")
    assert errors[2].startswith(f"{EVENTS_TOPIC}[0]@2: records[0] (metric): rank=134217728")
    assert errors[3].startswith(f"{EVENTS_TOPIC}[0]@3: records[0] (spans): start_ns[0]=0 not in")
    # The good messages after them were windowed: job a's two windows, job z's summary.
    assert stats.window.received == 5
    assert pipeline.windows == 3
    for error in errors:
        assert "\n" not in error


def test_one_bad_record_rejects_its_whole_message() -> None:
    bus = MemoryBus(partitions=1)
    pipeline = BusStreamJob(bus, detectors=[], window_s=5.0)
    good = spans("a", T0)
    bus.publish(EVENTS_TOPIC, encode_batch([good, StepRecord(job_id="a", rank=0, step=0,
                                                              start_ns=T0, duration_ns=-1)]))
    pipeline.poll_once(timeout_s=0.0)
    pipeline.finish()
    stats = pipeline.stats()
    assert stats.decode.rejected == 1
    assert (stats.validate.received, stats.validate.emitted, stats.validate.rejected) == (2, 0, 2)
    assert stats.window.received == 0, "the valid span batch of the rejected message was applied"
    assert pipeline.windows == 0


def test_an_unexpected_exception_while_decoding_dead_letters_the_message(monkeypatch) -> None:
    from trainscope.engine import intake as module

    real = module.decode_envelope

    def fragile(payload: bytes):
        if payload == b"boom":
            raise RecursionError("maximum recursion depth exceeded")
        return real(payload)

    monkeypatch.setattr(module, "decode_envelope", fragile)
    bus = MemoryBus(partitions=1)
    pipeline = BusStreamJob(bus, detectors=[], window_s=5.0)
    bus.publish(EVENTS_TOPIC, b"boom")
    bus.publish(EVENTS_TOPIC, encode_batch([spans("a", T0)]))
    pipeline.poll_once(timeout_s=0.0)
    pipeline.finish()
    assert pipeline.stats().decode.rejected == 1
    (letter,) = MemoryBus.consumer(bus, [DEAD_LETTER_TOPIC], "check").poll(timeout_s=0.0)
    assert letter.value == b"boom"
    assert letter.key == (f"{EVENTS_TOPIC}[0]@0: decoding raised RecursionError: maximum "
                          "recursion depth exceeded | payload 4 bytes sha256:"
                          f"{hashlib.sha256(b'boom').hexdigest()}").encode()
    assert pipeline.windows == 1


def test_records_handed_over_directly_are_rejected_one_by_one(sink) -> None:
    pipeline = EmbeddedStreamJob([], window_s=5.0, sink=sink)
    bad = StepRecord(job_id="a", rank=0, step=0, start_ns=T0, duration_ns=float("nan"))
    pipeline.process_records([spans("a", T0), bad, spans("a", T0 + 10**9)])
    pipeline.finish()
    stats = pipeline.stats()
    assert (stats.validate.received, stats.validate.emitted, stats.validate.rejected) == (3, 2, 1)
    assert stats.window.received == 4
    ((topic, partition, offset, error),) = dead_letters(sink)
    assert (topic, partition, offset) == ("", -1, -1)
    assert error.startswith("records[1] (step): ")
    payload = run_query(sink.client, "SELECT payload FROM dead_letters")[1][0][0]
    assert b"duration_ns" in bytes.fromhex(payload)


def test_a_poll_of_garbage_costs_one_dead_letter_insert(sink) -> None:
    pipeline = EmbeddedStreamJob([], window_s=5.0, sink=sink)
    messages = [Message(EVENTS_TOPIC, 0, i, None, msgspec.msgpack.encode([i]))
                for i in range(500)]
    pipeline.process_messages(messages)
    assert sink.stats.dead_letters == 500
    assert len(dead_letters(sink)) == 500


def test_an_engine_failure_sets_aside_only_that_jobs_messages(monkeypatch) -> None:
    bus = MemoryBus(partitions=1)
    pipeline = BusStreamJob(bus, detectors=[], window_s=5.0)
    real = pipeline.engine.add_spans

    def fragile(batches, source=0):
        if batches[0].job_id == "b":
            raise ValueError("more than 1048576 distinct functions in one job")
        return real(batches, source)

    monkeypatch.setattr(pipeline.engine, "add_spans", fragile)
    for job in ("a", "b", "a"):
        bus.publish(EVENTS_TOPIC, encode_batch([spans(job, T0)]))
    pipeline.poll_once(timeout_s=0.0)
    pipeline.finish()
    stats = pipeline.stats()
    assert (stats.decode.received, stats.decode.emitted, stats.decode.rejected) == (3, 2, 1)
    (letter,) = MemoryBus.consumer(bus, [DEAD_LETTER_TOPIC], "check").poll(timeout_s=0.0)
    assert letter.key.decode().startswith(
        f"{EVENTS_TOPIC}[0]@1: window engine raised ValueError: more than 1048576 distinct "
        "functions in one job on job 'b'")
    assert [v.job_id for v in pipeline.engine.close_all()] == [] and pipeline.windows == 1
