"""The embedded bus: partitioned topics in process memory, with consumer-group positions.

It behaves like a Kafka topic where that matters to the pipeline (per-key order, committed
positions, redelivery of what was not committed) so code tested on it runs unchanged on Kafka.
Thread-safe: producers and the consumer may live on different threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from trainscope.transport.protocol import DEFAULT_PARTITIONS, Message, partition_for


class MemoryBus:
    def __init__(self, partitions: int = DEFAULT_PARTITIONS) -> None:
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.partitions = partitions
        self._logs: dict[str, list[list[Message]]] = {}
        self._committed: dict[tuple[str, str, int], int] = {}
        self._counter = 0
        self._cond = threading.Condition()
        self._closed = False

    def _log(self, topic: str) -> list[list[Message]]:
        log = self._logs.get(topic)
        if log is None:
            log = self._logs[topic] = [[] for _ in range(self.partitions)]
        return log

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("publish on a closed bus")
            partition = partition_for(key, self.partitions, self._counter)
            self._counter += 1
            log = self._log(topic)[partition]
            log.append(
                Message(topic, partition, len(log), key, value, int(time.time() * 1000))
            )
            self._cond.notify_all()

    def flush(self, timeout_s: float = 30.0) -> None:
        """Publishing is synchronous here; nothing is ever pending."""

    def consumer(
        self, topics: list[str], group: str, *, sole_member: bool = False
    ) -> MemoryConsumer:
        """Every consumer reads every partition (a bus inside one process has one member per
        group), so ``sole_member`` holds already."""
        return MemoryConsumer(self, list(topics), group)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def message_count(self, topic: str) -> int:
        with self._cond:
            return sum(len(p) for p in self._logs.get(topic, []))


class MemoryConsumer:
    def __init__(self, bus: MemoryBus, topics: list[str], group: str) -> None:
        self._bus = bus
        self._topics = topics
        self._group = group
        with bus._cond:
            self._positions = {
                (t, p): bus._committed.get((group, t, p), 0)
                for t in topics
                for p in range(bus.partitions)
            }

    def _take(self, max_records: int) -> list[Message]:
        out: list[Message] = []
        for (topic, partition), position in self._positions.items():
            log = self._bus._log(topic)[partition]
            if position < len(log):
                chunk = log[position : position + max_records - len(out)]
                out.extend(chunk)
                self._positions[(topic, partition)] = position + len(chunk)
                if len(out) >= max_records:
                    break
        return out

    def poll(self, max_records: int = 10_000, timeout_s: float = 0.1) -> list[Message]:
        deadline = time.monotonic() + timeout_s
        with self._bus._cond:
            while True:
                out = self._take(max_records)
                remaining = deadline - time.monotonic()
                if out or remaining <= 0 or self._bus._closed:
                    return out
                self._bus._cond.wait(remaining)

    def assignment(self) -> list[tuple[str, int]]:
        return list(self._positions)

    def commit(
        self,
        positions: Mapping[tuple[str, int], int] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        with self._bus._cond:
            chosen = self._positions if positions is None else positions
            for (topic, partition), position in chosen.items():
                self._bus._committed[(self._group, topic, partition)] = position

    def close(self) -> None:
        """Positions not committed are forgotten: the next consumer re-reads them."""
