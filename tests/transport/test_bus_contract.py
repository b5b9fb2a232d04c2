"""The bus contract: every Bus implementation behaves the same where the pipeline relies on it.

Each test runs against the in-memory bus and against KafkaBus on a real Kafka-protocol broker.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from trainscope.schemas import StepRecord, decode_batch, encode_batch
from trainscope.transport.bus import Bus, Consumer, Message, open_bus, rank_key

DEADLINE_S = 15.0


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus(request: pytest.FixtureRequest) -> Iterator[Bus]:
    if request.param == "memory":
        opened: Bus = open_bus("memory")
    else:
        from trainscope.transport.kafka import KafkaBus

        broker = request.getfixturevalue("kafka_broker")
        # A short session makes each group join take about a second on the test broker.
        opened = KafkaBus(broker.bootstrap_servers, session_timeout_ms=2_000)
    yield opened
    opened.close()


def unique(prefix: str) -> str:
    """The session's broker is shared: every test uses topics and groups of its own."""
    return f"test.{prefix}.{uuid.uuid4().hex[:10]}"


def consume(consumer: Consumer, expected: int, timeout_s: float = DEADLINE_S) -> list[Message]:
    """Poll until ``expected`` messages arrived, then once more to catch any extra ones."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        out.extend(consumer.poll(max_records=1000, timeout_s=0.2))
    out.extend(consumer.poll(max_records=1000, timeout_s=0.3))
    return out


def steps(job: str, rank: int, first: int, count: int) -> list[StepRecord]:
    return [
        StepRecord(job_id=job, rank=rank, step=s, start_ns=s * 10**9, duration_ns=10**9 + rank)
        for s in range(first, first + count)
    ]


def test_encoded_batches_round_trip(bus: Bus) -> None:
    topic = unique("events")
    sent = {rank: steps("job-a", rank, 0, 50) for rank in range(3)}
    for rank, records in sent.items():
        bus.publish(topic, encode_batch(records), key=rank_key("job-a", rank))
    bus.flush(10)

    consumer = bus.consumer([topic], unique("group"))
    messages = consume(consumer, 3)
    consumer.close()

    assert len(messages) == 3
    received = {m.key: decode_batch(m.value) for m in messages}
    assert received == {rank_key("job-a", rank): records for rank, records in sent.items()}
    assert all(m.topic == topic for m in messages)


def test_per_key_order_is_preserved(bus: Bus) -> None:
    topic = unique("order")
    keys = [rank_key("job-o", rank) for rank in range(6)]
    per_key = 300
    for seq in range(per_key):
        for key in keys:
            bus.publish(topic, f"{seq}".encode(), key=key)
    bus.flush(20)

    consumer = bus.consumer([topic], unique("group"))
    messages = consume(consumer, per_key * len(keys))
    consumer.close()

    assert len(messages) == per_key * len(keys)
    for key in keys:
        mine = [m for m in messages if m.key == key]
        assert [int(m.value) for m in mine] == list(range(per_key)), key
        assert len({m.partition for m in mine}) == 1
        offsets = [m.offset for m in mine]
        assert offsets == sorted(offsets)


def test_several_topics(bus: Bus) -> None:
    first, second = unique("first"), unique("second")
    for i in range(5):
        bus.publish(first, f"a{i}".encode(), key=b"k")
        bus.publish(second, f"b{i}".encode(), key=b"k")
    bus.flush(10)

    both = bus.consumer([first, second], unique("group"))
    only_second = bus.consumer([second], unique("group"))
    got_both = consume(both, 10)
    got_second = consume(only_second, 5)
    both.close()
    only_second.close()

    assert sorted((m.topic, m.value) for m in got_both) == sorted(
        [(first, f"a{i}".encode()) for i in range(5)]
        + [(second, f"b{i}".encode()) for i in range(5)]
    )
    assert sorted(m.value for m in got_second) == [f"b{i}".encode() for i in range(5)]
    assert {m.topic for m in got_second} == {second}


def test_new_member_resumes_after_committed_position(bus: Bus) -> None:
    topic, group = unique("resume"), unique("group")
    for i in range(10):
        bus.publish(topic, f"old{i}".encode(), key=b"k")
    bus.flush(10)
    first = bus.consumer([topic], group)
    assert len(consume(first, 10)) == 10
    first.commit()
    first.close()

    for i in range(4):
        bus.publish(topic, f"new{i}".encode(), key=b"k")
    bus.flush(10)
    second = bus.consumer([topic], group)
    got = consume(second, 4)
    second.close()

    assert [m.value for m in got] == [f"new{i}".encode() for i in range(4)]


def test_uncommitted_messages_are_redelivered(bus: Bus) -> None:
    topic, group = unique("redeliver"), unique("group")
    for i in range(6):
        bus.publish(topic, f"done{i}".encode(), key=b"k")
    bus.flush(10)
    first = bus.consumer([topic], group)
    assert len(consume(first, 6)) == 6
    first.commit()
    for i in range(3):
        bus.publish(topic, f"lost{i}".encode(), key=b"k")
    bus.flush(10)
    assert [m.value for m in consume(first, 3)] == [f"lost{i}".encode() for i in range(3)]
    first.close()  # without committing the last three

    second = bus.consumer([topic], group)
    got = consume(second, 3)
    second.close()

    assert [m.value for m in got] == [f"lost{i}".encode() for i in range(3)]


def test_each_group_gets_everything(bus: Bus) -> None:
    topic = unique("fanout")
    for i in range(20):
        bus.publish(topic, f"{i}".encode(), key=f"k{i % 3}".encode())
    bus.flush(10)

    groups = [bus.consumer([topic], unique("group")) for _ in range(2)]
    results = [consume(consumer, 20) for consumer in groups]
    for consumer in groups:
        consumer.close()

    for got in results:
        assert sorted(int(m.value) for m in got) == list(range(20))


def test_poll_on_empty_topic_returns_empty_promptly(bus: Bus) -> None:
    consumer = bus.consumer([unique("empty")], unique("group"))
    try:
        for _ in range(3):
            started = time.monotonic()
            assert consumer.poll(timeout_s=0.3) == []
            elapsed = time.monotonic() - started
            assert elapsed < 1.5, f"poll(timeout_s=0.3) took {elapsed:.2f}s"
    finally:
        consumer.close()
