"""The message bus: one small protocol, an in-memory and a Kafka implementation.

Producers ``publish`` encoded batches to a topic with a key (``job/rank``) that picks the
partition, so one rank's messages stay in order. Consumers in a group ``poll`` messages and
``commit`` their positions; a consumer that restarts resumes from the committed position
(at-least-once: what was polled but not committed is delivered again).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

EVENTS_TOPIC = "trainscope.events"
METRICS_TOPIC = "trainscope.metrics"
CONTROL_TOPIC = "trainscope.control"
DEAD_LETTER_TOPIC = "trainscope.dead-letter"
ALL_TOPICS = (EVENTS_TOPIC, METRICS_TOPIC, CONTROL_TOPIC, DEAD_LETTER_TOPIC)

DEFAULT_PARTITIONS = 4


class BusError(RuntimeError):
    """The bus cannot be reached or refused an operation."""


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

    def consumer(self, topics: list[str], group: str) -> Consumer: ...

    def close(self) -> None: ...


def partition_for(key: bytes | None, partitions: int, counter: int) -> int:
    """Same key, same partition; keyless messages spread round-robin."""
    if key is None:
        return counter % partitions
    return zlib.crc32(key) % partitions


def rank_key(job_id: str, rank: int) -> bytes:
    return f"{job_id}/{rank}".encode()


def open_bus(url: str) -> Bus:
    """``memory`` for the embedded bus, ``kafka://HOST:PORT[,HOST:PORT...]`` for Kafka."""
    if url in ("memory", "memory://"):
        from trainscope.streams.memory_bus import MemoryBus

        return MemoryBus()
    if url.startswith("kafka://"):
        from trainscope.streams.kafka_bus import KafkaBus

        servers = url.removeprefix("kafka://").strip("/")
        if not servers:
            raise ValueError(f"bus URL {url!r} names no broker (expected kafka://HOST:PORT)")
        return KafkaBus(servers)
    raise ValueError(f"unknown bus URL {url!r}: expected 'memory' or 'kafka://HOST:PORT'")
