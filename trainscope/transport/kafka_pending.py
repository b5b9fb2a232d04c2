"""The Kafka bus's ledger of what ``publish`` accepted and Kafka has not settled yet.

Not a producer's buffer: producers hand their records to the one outbox of the transport layer
(:class:`trainscope.transport.outbox.Outbox`), which holds them, applies the drop policy, counts
and retries. This ledger only tracks the messages between ``publish`` and Kafka's verdict, and
drops nothing: its bounds (messages and bytes) make ``offer`` refuse with ``BusError``, at once,
instead of letting a dead broker stall or bloat a training process; the producer's outbox keeps
a refused message and sends it again later.

Callers on any thread ``offer`` messages; the bus's event loop ``take``s them for the producer
and ``settle``s each one exactly once: delivered when Kafka acknowledged it, failed otherwise
(including when the bus gives up on a producer during an outage).

Counts (messages): ``offered`` = ``delivered`` + ``failed`` + pending; ``rejected`` were
refused by ``offer`` and never taken. (A producer's "published" is ``delivered`` here.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainscope.transport.protocol import BusError, DeliveryCallback


@dataclass(eq=False)
class Entry:
    topic: str
    value: bytes
    key: bytes | None
    on_done: DeliveryCallback | None = None
    sent_at: float = 0.0  # monotonic time the producer took it; 0 while queued
    settled: bool = field(default=False)


class PendingMessages:
    """The Kafka bus's messages between ``publish`` and Kafka's verdict, with their bounds and
    counts; it refuses when full and never drops (module docstring)."""

    def __init__(
        self,
        servers: str,
        max_pending: int,
        max_pending_bytes: int,
        max_message_bytes: int,
        on_trouble: Callable[[], None],
    ) -> None:
        self.servers = servers
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.max_message_bytes = max_message_bytes
        self.counts = {"offered": 0, "delivered": 0, "failed": 0, "rejected": 0}
        self.last_error = ""
        self._on_trouble = on_trouble  # the broker may have lost state: forget cached facts
        self._cond = threading.Condition()
        self._queue: deque[Entry] = deque()
        self._pending = 0  # offered, neither delivered nor failed yet
        self._pending_bytes = 0
        self._draining = False
        self._failed_since_wait = 0
        self._down_until = 0.0

    @property
    def pending(self) -> int:
        return self._pending

    def offer(
        self, topic: str, value: bytes, key: bytes | None, on_done: DeliveryCallback | None = None
    ) -> bool:
        """Accept a message or raise ``BusError``; ``True`` if the drain must be started."""
        size = len(value)
        with self._cond:
            problem = ""
            if size > self.max_message_bytes:
                problem = f"message of {size} bytes exceeds the {self.max_message_bytes}-byte limit"
            elif time.monotonic() < self._down_until:
                problem = self.last_error
            elif self._pending >= self.max_pending or (
                self._pending and self._pending_bytes + size > self.max_pending_bytes
            ):
                problem = (
                    f"{self._pending} messages ({self._pending_bytes} bytes) still pending for "
                    f"Kafka at {self.servers}; the broker is slow or unreachable"
                    + self._last_error_note()
                )
            if problem:
                self.counts["rejected"] += 1
                self._on_trouble()
                raise BusError(problem)
            self._queue.append(Entry(topic, value, key, on_done))
            self._pending += 1
            self._pending_bytes += size
            self.counts["offered"] += 1
            wake = not self._draining
            self._draining = True
            return wake

    def take(self) -> Entry | None:
        """The next message to send; ``None`` (and the drain ends) when there is none."""
        with self._cond:
            if self._queue:
                entry = self._queue.popleft()
                entry.sent_at = time.monotonic()
                return entry
            self._draining = False
            return None

    def fail_queued(self, error: BaseException) -> None:
        with self._cond:
            rest = list(self._queue)
            self._queue.clear()
        for entry in rest:
            self.settle(entry, error)

    def settle(self, entry: Entry, outcome: BaseException | asyncio.Future[Any] | None) -> None:
        """Record the outcome of ``entry``; later outcomes for the same entry are ignored."""
        if isinstance(outcome, asyncio.Future):
            outcome = outcome.exception() if not outcome.cancelled() else BusError("cancelled")
        with self._cond:
            if entry.settled:
                return
            entry.settled = True
            self._pending -= 1
            self._pending_bytes -= len(entry.value)
            if outcome is None:
                self.counts["delivered"] += 1
            else:
                self.counts["failed"] += 1
                if entry.on_done is None:  # a tracked message's failure goes to its caller
                    self._failed_since_wait += 1
                self.last_error = str(outcome) or type(outcome).__name__
                self._on_trouble()
            if not self._pending:
                self._cond.notify_all()
        if entry.on_done is not None:
            entry.on_done(outcome)

    def mark_down(self, error: str, backoff_s: float) -> None:
        """Reject offers for ``backoff_s``: a connection attempt just failed."""
        with self._cond:
            self.last_error = error
            self._down_until = time.monotonic() + backoff_s

    def wait_settled(self, timeout_s: float) -> None:
        """Wait until nothing is pending; ``BusError`` on timeout or for failed deliveries."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._on_trouble()
                    raise BusError(
                        f"flush timed out after {timeout_s:g}s: {self._pending} messages not "
                        f"delivered to Kafka at {self.servers}" + self._last_error_note()
                    )
                self._cond.wait(remaining)
            failed, self._failed_since_wait = self._failed_since_wait, 0
            if failed:
                raise BusError(
                    f"{failed} messages could not be delivered to Kafka at {self.servers}: "
                    f"{self.last_error}"
                )

    def _last_error_note(self) -> str:
        return f" (last error: {self.last_error})" if self.last_error else ""

