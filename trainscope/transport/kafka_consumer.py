"""The consumer side of the Kafka bus: one member of a consumer group, driven synchronously.

After a rebalance a member reads on from where it got to in the partitions it keeps
(:class:`~trainscope.transport.kafka_group.KeepPositions`); a group opened ``sole_member``
gives every partition to one member (:mod:`trainscope.transport.kafka_group`), and its other
members' ``poll`` raises :class:`GroupHeldElsewhere`.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import InconsistentGroupProtocolError

from trainscope.transport import aiokafka_private
from trainscope.transport.kafka_group import KeepPositions, SoleMemberAssignor
from trainscope.transport.kafka_support import EventLoopThread, start_client
from trainscope.transport.protocol import BusError, GroupHeldElsewhere, Message
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
    listener: KeepPositions | None = None,
    assignor: SoleMemberAssignor | None = None,
) -> AIOKafkaConsumer:
    """``client_kwargs``: the TLS/SASL settings of every client of the bus (``security``'s).
    ``assignor``: a :class:`SoleMemberAssignor` instead of aiokafka's round robin."""
    strategy: dict[str, Any] = {}
    if assignor is not None:
        strategy["partition_assignment_strategy"] = (assignor,)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        client_id=client_id,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=session_timeout_ms,
        heartbeat_interval_ms=max(100, session_timeout_ms // 5),
        rebalance_timeout_ms=session_timeout_ms,
        request_timeout_ms=request_timeout_ms,
        **strategy,
        **(client_kwargs or {}),
    )
    listener = listener if listener is not None else KeepPositions()
    listener.consumer = consumer
    consumer.subscribe(topics, listener=listener)
    try:
        await start_client(consumer, bootstrap_servers, security)
    except BusError as exc:
        if isinstance(exc.__context__, InconsistentGroupProtocolError):
            # The broker refused the join: the group's members use another assignment protocol.
            raise GroupHeldElsewhere(
                f"consumer group {group!r} on Kafka at {bootstrap_servers} has members of "
                f"another kind (another assignment protocol than "
                f"{assignor.name if assignor is not None else 'roundrobin'!r})"
            ) from None
        raise
    return consumer


class KafkaConsumer:
    """One member of a consumer group; positions advance only on :meth:`commit`."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        thread: EventLoopThread,
        bootstrap_servers: str,
        call_timeout_s: float,
        *,
        group: str = "",
        listener: KeepPositions | None = None,
        assignor: SoleMemberAssignor | None = None,
    ) -> None:
        self._consumer = consumer
        self._thread = thread
        self._servers = bootstrap_servers
        self._call_timeout_s = call_timeout_s
        self._closed = False
        self.group = group
        self._listener = listener if listener is not None else KeepPositions()
        self._assignor = assignor
        self._checked_rebalance = 0  # the last rebalance whose assignment was checked whole

    def _held_elsewhere(self) -> None:
        """A sole-member group that handed this member nothing, or only some partitions (a
        member of another kind shares the group), belongs to another member."""
        assignor = self._assignor
        if assignor is None or not self._listener.rebalances:
            return
        if not assignor.holds:
            raise GroupHeldElsewhere(
                f"consumer group {self.group!r} on Kafka at {self._servers} is held by another "
                f"member ({assignor.holder or 'unknown'}), which reads every partition"
            )
        if self._checked_rebalance == self._listener.rebalances:
            return
        self._checked_rebalance = self._listener.rebalances
        assigned = self._consumer.assignment()
        missing = sorted(
            f"{topic}[{partition}]"
            for topic in sorted(self._consumer.subscription())
            for partition in self._consumer.partitions_for_topic(topic) or ()
            if TopicPartition(topic, partition) not in assigned
        )
        if missing:
            raise GroupHeldElsewhere(
                f"consumer group {self.group!r} on Kafka at {self._servers} has another member "
                f"that holds {', '.join(missing)}"
            )

    def poll(self, max_records: int = 10_000, timeout_s: float = 0.1) -> list[Message]:
        if self._closed:
            raise BusError("poll on a closed consumer")
        self._held_elsewhere()
        batches = self._call(
            self._getmany(int(timeout_s * 1000), max_records), timeout_s + self._call_timeout_s,
            "poll",
        )
        self._held_elsewhere()  # the poll may have completed a join that handed it nothing
        return [
            Message(r.topic, r.partition, r.offset, r.key, r.value or b"", r.timestamp)
            for records in batches.values()
            for r in records
        ]

    async def _getmany(self, timeout_ms: int, max_records: int) -> dict[Any, list[Any]]:
        batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        # On the loop's thread, where rebalances run: what was handed out is where to resume.
        handed = self._listener.handed
        for tp, records in batches.items():
            if records:
                handed[tp] = records[-1].offset + 1
        return batches

    def group_changes(self) -> int:
        """How often this member's partitions were revoked or assigned so far: a poll during
        which it changed may have waited on a rebalance, not on the stream."""
        return self._listener.changes

    def assignment(self) -> list[tuple[str, int]]:
        """The (topic, partition) pairs this member reads now; none while the group
        rebalances (the client keeps the old assignment meanwhile but delivers nothing)."""
        if self._listener.rebalancing:
            return []
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    def rewind(self, partitions: list[tuple[str, int]]) -> None:
        """Read ``partitions`` from their oldest offset again (their log was replaced)."""
        assigned = self._consumer.assignment()
        tps = [tp for t, p in partitions if (tp := TopicPartition(t, p)) in assigned]
        if tps:
            self._call(self._consumer.seek_to_beginning(*tps), self._call_timeout_s, "rewind")
            for tp in tps:
                self._listener.handed.pop(tp, None)

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
        if self._listener.rebalancing:
            # The broker would refuse it; and after the rebalance the positions may not be ours.
            raise BusError(f"commit on Kafka at {self._servers}: group {self.group!r} is "
                           f"rebalancing")
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
