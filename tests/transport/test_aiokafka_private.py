"""aiokafka's private API as the Kafka bus uses it is still there, and still the same.

``aiokafka_private`` holds every access to an aiokafka internal and records the source digest of
each upstream function whose behaviour the bus relies on. These tests fail, naming what changed
or is missing and the installed version, when the installed aiokafka is not the one the adapter
was written for.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from kafka_broker import TansuBroker
from upstream_source import changed_functions, report, source_digest, upstream_source

from trainscope.transport import aiokafka_private
from trainscope.transport.aiokafka_private import AiokafkaPrivateApiError
from trainscope.transport.kafka_support import create_topics, fail_pending
from trainscope.transport.protocol import BusError

ADAPTER = "trainscope/transport/aiokafka_private.py"
NOWHERE = "127.0.0.1:1"  # nothing here connects


def test_upstream_functions_are_as_recorded() -> None:
    changed = changed_functions(aiokafka_private.UPSTREAM_DIGESTS)
    assert not changed, report(
        "aiokafka",
        aiokafka_private.AIOKAFKA_VERSION,
        aiokafka_private.installed_version(),
        ADAPTER,
        changed,
    )


def test_a_changed_upstream_function_is_named() -> None:
    name = "aiokafka.consumer.group_coordinator:GroupCoordinator._maybe_leave_group"
    recorded = {name: aiokafka_private.UPSTREAM_DIGESTS[name]}
    source = upstream_source(name)
    reindented = "\n".join("  " + line if line else line for line in source.splitlines())
    assert changed_functions(recorded, lambda _: reindented) == []
    modified = source.replace("self.generation > 0", "self.generation >= 0")
    assert modified != source
    assert changed_functions(recorded, lambda _: modified) == [
        f"{name}: digest now {source_digest(modified)!r}, recorded {recorded[name]!r}"
    ]


def test_producer_and_admin_internals_exist() -> None:
    async def check() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=NOWHERE)
        admin = AIOKafkaAdminClient(bootstrap_servers=NOWHERE)
        consumer = AIOKafkaConsumer("t", group_id="g", bootstrap_servers=NOWHERE)
        try:
            # A batch waiting for the sender, planted as send() would (which needs a broker).
            accumulator = producer._message_accumulator
            delivery = await accumulator.add_message(TopicPartition("t", 0), b"k", b"v", 1.0)
            aiokafka_private.fail_batches(producer, BusError("the bus gave up"))
            assert isinstance(delivery.exception(), BusError)
            assert isinstance(aiokafka_private.network_client(producer), AIOKafkaClient)
            assert isinstance(aiokafka_private.network_client(admin), AIOKafkaClient)
            assert aiokafka_private.group_coordinator(consumer) is None  # before start()
        finally:
            await producer.stop()
            await admin.close()
            await consumer.stop()

    asyncio.run(check())


@pytest.mark.kafka
def test_group_coordinator_internals_exist(kafka_broker: TansuBroker) -> None:
    topic = f"test.private.{uuid.uuid4().hex[:10]}"

    async def check() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap_servers)
        await admin.start()
        try:
            await create_topics(admin, [topic], 1, 1)
        finally:
            await admin.close()
        consumer = AIOKafkaConsumer(
            topic,
            group_id=f"g-{topic}",
            bootstrap_servers=kafka_broker.bootstrap_servers,
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
        )
        await consumer.start()
        try:
            while not consumer.assignment():  # in the group once partitions are assigned
                await consumer.getmany(timeout_ms=200)
            coordinator = aiokafka_private.group_coordinator(consumer)
            assert aiokafka_private.generation(coordinator) >= 0
            await aiokafka_private.leave_group(coordinator, 5.0)
            assert aiokafka_private.generation(coordinator) == -1  # reset: left the group
        finally:
            await consumer.stop()

    asyncio.run(asyncio.wait_for(check(), 60.0))


def test_every_adapter_function_is_tried_on_real_objects() -> None:
    tried = {
        "installed_version",  # below
        "warn_once",  # test_a_missing_attribute_is_logged_once_where_the_bus_carries_on
        "fail_batches",
        "network_client",
        "group_coordinator",  # test_producer_and_admin_internals_exist
        "generation",
        "leave_group",  # test_group_coordinator_internals_exist
    }
    functions = {
        name
        for name, function in inspect.getmembers(aiokafka_private, inspect.isfunction)
        if function.__module__ == aiokafka_private.__name__ and not name.startswith("_")
    }
    assert functions == tried
    assert aiokafka_private.installed_version() == aiokafka_private.AIOKAFKA_VERSION


def test_a_missing_attribute_is_named_with_the_version() -> None:
    with pytest.raises(
        AiokafkaPrivateApiError,
        match=r"object has no attribute '_message_accumulator'.*aiokafka 0\.14\.0",
    ):
        aiokafka_private.fail_batches(object(), BusError("x"))  # type: ignore[arg-type]
    with pytest.raises(AiokafkaPrivateApiError, match="'_coordinator'"):
        aiokafka_private.group_coordinator(object())  # type: ignore[arg-type]


def test_a_missing_attribute_is_logged_once_where_the_bus_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Elsewhere:  # a producer of another aiokafka, as fail_pending would meet it
        pass

    with caplog.at_level(logging.ERROR, logger=aiokafka_private.__name__):
        fail_pending(Elsewhere(), BusError("the bus gave up"))
        fail_pending(Elsewhere(), BusError("the bus gave up"))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "Elsewhere has no attribute '_message_accumulator'" in errors[0]
    assert "aiokafka 0.14.0" in errors[0]


def test_failing_a_batch_queued_again_for_a_retry_logs_nothing(caplog) -> None:
    """During an outage a batch is sent once, fails, and is queued again (``reenqueue``: out of
    the accumulator's pending set, its first send's removal callback still on it). Failing it
    back then made that callback raise ``KeyError``, which asyncio printed as an ERROR with a
    traceback into the training job's log (seen in CI's outage test). With aiokafka's real
    producer and accumulator: the batch fails with the bus's error, and nothing is logged at
    warning or above."""
    caplog.set_level(logging.WARNING)

    async def check() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=NOWHERE)
        try:
            accumulator = producer._message_accumulator
            tp = TopicPartition("t", 0)
            delivery = await accumulator.add_message(tp, b"k", b"v", 1.0)
            batch = accumulator._pop_batch(tp)  # its first send: the callback registered
            accumulator.reenqueue(batch)  # a retriable error: queued again
            aiokafka_private.fail_batches(producer, BusError("the bus gave up"))
            await asyncio.sleep(0.05)  # the callbacks run
            assert isinstance(delivery.exception(), BusError)
            assert not accumulator._pending_batches  # the callback removed it
        finally:
            await producer.stop()

    asyncio.run(check())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
