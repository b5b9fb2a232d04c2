"""The background sender: a bounded queue drained by a daemon thread.

The training thread only calls :meth:`Sender.submit` (append under a lock, or drop and count
when full). The daemon thread condenses closed windows, encodes batches and publishes them.
When the bus is unreachable, encoded batches wait in a bounded outbox and the thread reconnects
with exponential backoff; what does not fit is dropped and counted, never waited for.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from trainscope.producers.torch.safety import Guard, log
from trainscope.schemas.codec import encode_batch
from trainscope.streams.bus import EVENTS_TOPIC, Bus
from trainscope.streams.summaries import message_chunks

# Rows per bus message (records, or the rows of a summary batch): large enough to amortise the
# per-message cost, small enough to stay far below Kafka's 1 MiB message limit with summaries of
# a few hundred bytes each.
MAX_BATCH_RECORDS = 500
FLUSH_TIMEOUT_S = 5.0

BusFactory = Callable[[], Bus]


class Sender:
    def __init__(
        self,
        *,
        bus_factory: BusFactory | None,
        owns_bus: bool = True,
        key: bytes,
        guard: Guard,
        capacity: int,
        flush_interval_s: float = 0.5,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        producers: list[Callable[[bool], list[Any]]] | None = None,
    ) -> None:
        self._bus_factory = bus_factory
        # A bus object handed in by the caller is theirs to close; one we opened is ours.
        self._owns_bus = owns_bus
        self._key = key
        self._guard = guard
        self.capacity = capacity
        self.flush_interval_s = flush_interval_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        # Called on the sender thread each round (argument: final round) for more records,
        # e.g. the summaries of windows that just closed.
        self._producers = producers or []
        self._tasks: deque[Callable[[], list[Any]]] = deque()
        self._queue: list[Any] = []
        self._outbox: deque[tuple[str, bytes, int]] = deque()  # (topic, payload, records)
        self._outbox_records = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._bus: Bus | None = None
        self._next_attempt = 0.0
        self._backoff_s = backoff_initial_s
        self.counts = {
            "submitted": 0,
            "sent": 0,
            "dropped": 0,
            "batches_sent": 0,
            "bus_errors": 0,
            "connects": 0,
            "unsent": 0,  # condensed but discarded because no bus is configured
        }
        self.bus_up = False

    # -- training thread ----------------------------------------------------------------------
    def submit(self, record: Any) -> bool:
        with self._cond:
            if len(self._queue) + self._outbox_records >= self.capacity or self._stopping:
                self.counts["dropped"] += 1
                return False
            self._queue.append(record)
            self.counts["submitted"] += 1
            if len(self._queue) >= MAX_BATCH_RECORDS:
                self._cond.notify()
        return True

    def submit_encoded(self, topic: str, payload: bytes, records: int) -> bool:
        """An already-encoded message for another topic (e.g. the op trace); same bound."""
        with self._cond:
            if self._outbox_records + len(self._queue) + records > self.capacity:
                self.counts["dropped"] += records
                return False
            self._outbox.append((topic, payload, records))
            self._outbox_records += records
            self.counts["submitted"] += records
        return True

    def submit_task(self, task: Callable[[], list[Any]]) -> None:
        """Run ``task`` on the sender thread; it returns records to send (heavy work goes here)."""
        with self._cond:
            self._tasks.append(task)
            self._cond.notify()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="trainscope-sender", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what can be sent within ``timeout_s``, then close the bus; never raises."""
        thread = self._thread
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if thread is not None:
            thread.join(timeout_s + 1.0)
        self._thread = None

    def reset_after_fork(self) -> None:
        """In a forked child the thread is gone and the bus belongs to the parent."""
        self._cond = threading.Condition()
        self._thread = None
        self._bus = None
        self._queue = []
        self._tasks.clear()
        self._outbox.clear()
        self._outbox_records = 0
        self._stopping = True

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out: dict[str, Any] = dict(self.counts)
            out["queued"] = len(self._queue) + self._outbox_records
            out["bus_up"] = self.bus_up
        return out

    # -- sender thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._stopping:
                    self._cond.wait(self.flush_interval_s)
                final = self._stopping
            try:
                self._round(final)
            except Exception as exc:  # the thread must survive anything
                self._guard.report("sender", exc)
            if final:
                break
        self._close_bus()

    def _round(self, final: bool) -> None:
        records: list[Any] = []
        while True:
            with self._cond:
                task = self._tasks.popleft() if self._tasks else None
            if task is None:
                break
            try:
                records.extend(task())
            except Exception as exc:
                self._guard.report("sender task", exc)
        for producer in self._producers:
            try:
                records.extend(producer(final))
            except Exception as exc:
                self._guard.report("window summaries", exc)
        with self._cond:
            records = self._queue + records
            self._queue = []
        self._enqueue_payloads(records)
        self._deliver(final)

    def _enqueue_payloads(self, records: list[Any]) -> None:
        for chunk in message_chunks(records, MAX_BATCH_RECORDS):
            with self._cond:
                room = self.capacity - self._outbox_records
                if room < len(chunk):
                    self.counts["dropped"] += len(chunk) - max(room, 0)
                    chunk = chunk[: max(room, 0)]
                if not chunk:
                    continue
                self._outbox_records += len(chunk)
            payload = encode_batch(chunk)
            with self._cond:
                self._outbox.append((EVENTS_TOPIC, payload, len(chunk)))

    def _deliver(self, final: bool) -> None:
        if not self._outbox:
            return
        if self._bus_factory is None:
            with self._cond:
                self.counts["unsent"] += self._outbox_records
                self._outbox.clear()
                self._outbox_records = 0
            return
        bus = self._connected_bus(final)
        if bus is None:
            return
        try:
            pending = list(self._outbox)
            for topic, payload, _ in pending:
                bus.publish(topic, payload, self._key)
            bus.flush(timeout_s=FLUSH_TIMEOUT_S)
        except Exception as exc:
            self._bus_failed(exc)
            return
        with self._cond:
            for _ in pending:
                _, _, n = self._outbox.popleft()
                self._outbox_records -= n
                self.counts["sent"] += n
                self.counts["batches_sent"] += 1
        self._backoff_s = self.backoff_initial_s

    def _connected_bus(self, final: bool) -> Bus | None:
        if self._bus is not None:
            return self._bus
        now = time.monotonic()
        if now < self._next_attempt and not final:
            return None
        assert self._bus_factory is not None
        try:
            self._bus = self._bus_factory()
        except Exception as exc:
            self._bus_failed(exc)
            return None
        self.counts["connects"] += 1
        self.bus_up = True
        return self._bus

    def _bus_failed(self, exc: Exception) -> None:
        self.counts["bus_errors"] += 1
        if self.bus_up or self.counts["bus_errors"] == 1:
            log.warning(
                "trainscope: the bus is unreachable (%s: %s); training continues, records wait "
                "in a bounded queue and are dropped (counted) when it is full; retrying in %.1fs",
                type(exc).__name__,
                exc,
                self._backoff_s,
            )
        self.bus_up = False
        self._close_bus()
        self._next_attempt = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)

    def _close_bus(self) -> None:
        bus, self._bus = self._bus, None
        if bus is None or not self._owns_bus:
            return
        try:
            bus.close()
        except Exception as exc:
            self._guard.report("bus close", exc)

