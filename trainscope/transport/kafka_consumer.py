"""The consumer side of the Kafka bus: one member of a consumer group, driven synchronously."""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from trainscope.transport import aiokafka_private
from trainscope.transport.kafka_support import EventLoopThread, start_client
from trainscope.transport.protocol import BusError, Message
from trainscope.transport.security import KafkaSecurity

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 2.0


async def start_consumer(
    topics: list[str],
    group: str,
    *,
    bootstrap_servers: str,
    client_id: str,
    session_timeout_ms: int,
    request_timeout_ms: int,
    security: KafkaSecurity | None = None,
    client_kwargs: dict[str, Any] | None = None,
) -> AIOKafkaConsumer:
    """``client_kwargs``: the TLS/SASL settings of every client of the bus (``security``'s)."""
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap_servers,
        client_id=client_id,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=max(100, session_timeout_ms // 5),
        rebalance_timeout_ms=session_timeout_ms,
        request_timeout_ms=request_timeout_ms,
        **(client_kwargs or {}),
    )
    await start_client(consumer, bootstrap_servers, security)
    return consumer


class KafkaConsumer:
    """One member of a consumer group; positions advance only on :meth:`commit`."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        thread: EventLoopThread,
        bootstrap_servers: str,
        call_timeout_s: float,
    ) -> None:
        self._consumer = consumer
        self._thread = thread
        self._servers = bootstrap_servers
        self._call_timeout_s = call_timeout_s
        self._closed = False

    def poll(self, max_records: int = 10_000, timeout_s: float = 0.1) -> list[Message]:
        if self._closed:
            raise BusError("poll on a closed consumer")
        batches = self._call(
            self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records),
            timeout_s + self._call_timeout_s,
            "poll",
        )
        return [
            Message(r.topic, r.partition, r.offset, r.key, r.value or b"", r.timestamp)
            for records in batches.values()
            for r in records
        ]

    def assignment(self) -> list[tuple[str, int]]:
        """The (topic, partition) pairs this member reads now."""
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def rewind(self, partitions: list[tuple[str, int]]) -> None:
        """Read ``partitions`` from their oldest offset again (their log was replaced)."""
        assigned = self._consumer.assignment()
        tps = [tp for t, p in partitions if (tp := TopicPartition(t, p)) in assigned]
        if tps:
            self._call(self._consumer.seek_to_beginning(*tps), self._call_timeout_s, "rewind")

    def commit(
        self,
        positions: Mapping[tuple[str, int], int] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Commit ``positions`` ((topic, partition) → next offset to read), or by default the
        position after the last polled message of every assigned partition. ``timeout_s``
        bounds the call (the client retries some failures internally until then)."""
        if self._closed:
            raise BusError("commit on a closed consumer")
        offsets = None
        if positions is not None:
            # After a rebalance, partitions this member no longer owns are not its to commit.
            assigned = self._consumer.assignment()
            offsets = {
                tp: offset
                for (t, p), offset in positions.items()
                if (tp := TopicPartition(t, p)) in assigned
            }
            if not offsets:
                return
        self._call(self._consumer.commit(offsets), timeout_s or self._call_timeout_s, "commit")

    def close(self) -> None:
        """Leave the group; positions not committed are re-read by the next member."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(_leave_and_stop(self._consumer), self._call_timeout_s, "close")
        except BusError as exc:
            log.warning("%s", exc)

    def _call(self, coro: Coroutine[Any, Any, Any], timeout_s: float, action: str) -> Any:
        what = f"{action} on Kafka at {self._servers}"
        try:
            return self._thread.run(coro, timeout_s, what)
        except BusError:
            raise
        except Exception as exc:
            raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc


async def _leave_and_stop(consumer: AIOKafkaConsumer) -> None:
    """Stop, leaving the group explicitly even in generation 0.

    aiokafka sends LeaveGroup only for generations > 0, but some Kafka-protocol brokers (Tansu)
    number a group's first generation 0; without the LeaveGroup the next member of the group
    waits for this one's session to time out.
    """
    try:
        coordinator = aiokafka_private.group_coordinator(consumer)
        if coordinator is not None and aiokafka_private.generation(coordinator) == 0:
            await aiokafka_private.leave_group(coordinator, LEAVE_TIMEOUT_S)
    except aiokafka_private.AiokafkaPrivateApiError as exc:
        aiokafka_private.warn_once(exc)  # leaving early only spares the next member a wait
    except Exception:
        log.debug("explicit LeaveGroup failed", exc_info=True)
    await consumer.stop()
