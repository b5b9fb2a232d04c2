"""The bus's event loop keeps aiokafka's own bookkeeping errors out of the training job's log.

During an outage a batch can be failed back (the bus's ``fail_batches``, or the producer's own
``fail_all``) after aiokafka took it out of its accumulator's pending set to send it again; the
callback aiokafka registered on the batch's first send then raises ``KeyError`` removing it, and
asyncio's default handler printed that as an ERROR with a traceback in the job's log (seen in
CI's outage test). Shown here with aiokafka's real accumulator on the bus's real loop thread:
the error is counted, logged at debug, and nothing reaches the log at warning or above; any
other exception in a callback still goes to asyncio's handler.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from aiokafka.cluster import ClusterMetadata
from aiokafka.producer.message_accumulator import MessageAccumulator
from aiokafka.structs import TopicPartition

from trainscope.transport.kafka_support import EventLoopThread


def _wait(condition, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_batch_failed_back_after_its_resend_was_queued_logs_nothing(caplog) -> None:
    caplog.set_level(logging.DEBUG)
    thread = EventLoopThread("test-loop")

    async def race() -> None:
        accumulator = MessageAccumulator(ClusterMetadata(), 16_384, 0, 30)
        tp = TopicPartition("t", 0)
        await accumulator.add_message(tp, b"k", b"v", timeout=1)
        batch = accumulator._pop_batch(tp)  # its first send: the removal callback registered
        accumulator.reenqueue(batch)  # a retriable error: out of the pending set, queued again
        accumulator.fail_all(RuntimeError("broker gone"))  # the outage fails it back
        await asyncio.sleep(0.05)  # the callback runs

    try:
        thread.run(race(), timeout_s=5, what="race")
        assert _wait(lambda: thread.library_errors == 1), thread.library_errors
    finally:
        thread.stop()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records
    assert [r for r in caplog.records if "pending-batch callback" in r.getMessage()]


def test_other_errors_in_callbacks_still_reach_asyncio(caplog) -> None:
    caplog.set_level(logging.ERROR)
    thread = EventLoopThread("test-loop")

    def broken() -> None:
        raise KeyError("not aiokafka's")

    try:
        thread.call_soon(broken)
        assert _wait(lambda: any("not aiokafka's" in str(r.exc_info) for r in caplog.records))
    finally:
        thread.stop()
    assert thread.library_errors == 0


@pytest.fixture(autouse=True)
def _no_stray_loops() -> None:
    asyncio.set_event_loop(None)
