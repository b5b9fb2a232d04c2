"""The bus protocol: what every bus implementation provides and every user may rely on.

Kept apart from :mod:`trainscope.transport.bus` (the ``open_bus`` factory) so that the
implementations import this module and only the factory imports them: no import cycle.

Producers ``publish`` encoded batches to a topic with a key (``job/rank``) that picks the
partition, so one rank's messages stay in order. Consumers in a group ``poll`` messages and
``commit`` their positions; a consumer that restarts resumes from the committed position
(at-least-once: what was polled but not committed is delivered again).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from trainscope.schemas.errors import TrainscopeError

DEFAULT_PARTITIONS = 4


class BusError(RuntimeError, TrainscopeError):
    """The bus cannot be reached or refused an operation."""


class GroupHeldElsewhere(BusError):
    """Another member of this consumer group holds every partition: this one was given none
    (a group whose members each need the whole stream, see
    :mod:`trainscope.transport.kafka_group`). Not retried: the member should leave."""


@dataclass(frozen=True, slots=True)
class Message:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int = 0


@runtime_checkable
class Consumer(Protocol):
    def poll(self, max_records: int = 10_000, timeout_s: float = 0.1) -> list[Message]:
        """Messages after this group's position; waits at most ``timeout_s`` for the first."""
        ...

    def commit(
        self,
        positions: Mapping[tuple[str, int], int] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Record ``positions`` ((topic, partition) → next offset to read) as processed, or by
        default everything polled so far; ``timeout_s`` bounds a call that waits on a server."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Bus(Protocol):
    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """Queue a message; it is sent by ``flush`` at the latest."""
        ...

    def flush(self, timeout_s: float = 30.0) -> None: ...

    def consumer(self, topics: list[str], group: str, *, sole_member: bool = False) -> Consumer:
        """A member of ``group``. ``sole_member``: the group's partitions are never split
        between members; one member gets them all and the others' ``poll`` raises
        ``GroupHeldElsewhere``."""
        ...

    def close(self) -> None: ...


DeliveryCallback = Callable[[BaseException | None], None]
"""Called once per message: ``None`` when the broker acknowledged it, else the error."""


@runtime_checkable
class TrackingBus(Bus, Protocol):
    """A bus that reports each message's outcome, so a producer can count acknowledgements
    instead of assuming them, and retry exactly what failed. It retries connections itself and
    logs the start and end of a broker outage once each."""

    def publish_tracked(
        self, topic: str, value: bytes, key: bytes | None, on_done: DeliveryCallback
    ) -> None:
        """Like ``publish``; ``on_done`` runs later, on any thread, exactly once."""
        ...


def partition_for(key: bytes | None, partitions: int, counter: int) -> int:
    """Same key, same partition; keyless messages spread round-robin."""
    if key is None:
        return counter % partitions
    return zlib.crc32(key) % partitions
