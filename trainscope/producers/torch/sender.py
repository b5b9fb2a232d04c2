"""The background sender: a bounded queue drained by a daemon thread.

The training thread only calls :meth:`Sender.submit` (append under a lock, or drop and count
when full). The daemon thread condenses closed windows, encodes batches and publishes them.
While the bus is unreachable, encoded batches wait in a bounded outbox and are retried with
exponential backoff; what does not fit is dropped and counted, never waited for.

"Delivered" means acknowledged by the broker. On a bus that reports each message's outcome
(:class:`~trainscope.transport.bus.TrackingBus`, e.g. Kafka) a batch counts as acked when its
acknowledgement arrives, and only a batch whose send failed is sent again; on other buses a
successful ``flush`` acknowledges what was published before it. The counts (in records) add up:

- ``sent`` (sends handed to the bus, a retry counts again) = ``acked`` + ``failed`` + in flight
- ``submitted`` (offered by training) = ``acked`` + ``dropped`` + queued + in flight + ``unsent``
  + ``abandoned``

A send that failed after the broker may have stored it (a timeout) is retried and can appear
twice on the topic; ``resent`` counts such retries.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainscope.producers.torch.outage import OutageLog
from trainscope.producers.torch.safety import Guard, log
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.summaries import message_chunks
from trainscope.transport.bus import EVENTS_TOPIC, Bus, TrackingBus

# Rows per bus message (records, or the rows of a summary batch): large enough to amortise the
# per-message cost, small enough to stay far below Kafka's 1 MiB message limit with summaries of
# a few hundred bytes each.
MAX_BATCH_RECORDS = 500
FLUSH_TIMEOUT_S = 5.0

BusFactory = Callable[[], Bus]


@dataclass(eq=False)
class _Batch:
    topic: str
    payload: bytes
    records: int
    attempts: int = 0


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
        self._outbox: deque[_Batch] = deque()  # encoded, waiting to be sent (or sent again)
        self._outbox_records = 0
        self._in_flight: set[_Batch] = set()  # handed to a tracking bus, outcome unknown
        self._in_flight_records = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._bus: Bus | None = None
        self._next_attempt = 0.0
        self._backoff_s = backoff_initial_s
        self._outage = OutageLog(capacity)
        self._bus_logs_outages = False  # a TrackingBus logs outages of a broker it reached
        self.counts = {
            "submitted": 0,  # records offered by training, accepted or not
            "sent": 0,  # record sends handed to the bus; a retry counts again
            "acked": 0,  # records the broker acknowledged: delivered
            "failed": 0,  # record sends that failed; each goes back to the outbox
            "resent": 0,  # record sends that were retries (may duplicate on the topic)
            "dropped": 0,  # records discarded because the bounded queue was full
            "abandoned": 0,  # records still held when the sender stopped: never delivered
            "batches_sent": 0,
            "batches_acked": 0,
            "bus_errors": 0,
            "connects": 0,
            "unsent": 0,  # condensed but discarded because no bus is configured
        }
        self.bus_up = False

    # -- training thread ----------------------------------------------------------------------
    def _held(self) -> int:
        return len(self._queue) + self._outbox_records + self._in_flight_records

    def submit(self, record: Any) -> bool:
        with self._cond:
            self.counts["submitted"] += 1
            if self._held() >= self.capacity or self._stopping:
                self.counts["dropped"] += 1
                return False
            self._queue.append(record)
            if len(self._queue) >= MAX_BATCH_RECORDS:
                self._cond.notify()
        return True

    def submit_encoded(self, topic: str, payload: bytes, records: int) -> bool:
        """An already-encoded message for another topic (e.g. the op trace); same bound."""
        with self._cond:
            self.counts["submitted"] += records
            if self._held() + records > self.capacity:
                self.counts["dropped"] += records
                return False
            self._outbox.append(_Batch(topic, payload, records))
            self._outbox_records += records
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
        self._outage = OutageLog(self.capacity)
        self._thread = None
        self._bus = None
        self._queue = []
        self._tasks.clear()
        self._outbox.clear()
        self._outbox_records = 0
        self._in_flight = set()
        self._in_flight_records = 0
        self._stopping = True

    def stats(self) -> dict[str, Any]:
        with self._cond:
            out: dict[str, Any] = dict(self.counts)
            out["queued"] = len(self._queue) + self._outbox_records
            out["in_flight"] = self._in_flight_records
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
        with self._cond:  # what is still held now will never be delivered: say so
            left = len(self._queue) + self._outbox_records + self._in_flight_records
            self.counts["abandoned"] += left
            self._queue = []
            self._outbox.clear()
            self._in_flight = set()
            self._outbox_records = self._in_flight_records = 0
        if left:
            log.warning("trainscope: %d records were not delivered before shutdown", left)

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
            self.counts["submitted"] += len(records)  # made here, on the sender thread
            records = self._queue + records
            self._queue = []
        self._enqueue_payloads(records)
        self._deliver(final)
        self._outage.dropping(self.counts["dropped"])

    def _enqueue_payloads(self, records: list[Any]) -> None:
        for chunk in message_chunks(records, MAX_BATCH_RECORDS):
            with self._cond:
                room = self.capacity - self._outbox_records - self._in_flight_records
                if room < len(chunk):
                    self.counts["dropped"] += len(chunk) - max(room, 0)
                    chunk = chunk[: max(room, 0)]
                if not chunk:
                    continue
                self._outbox_records += len(chunk)
            payload = encode_batch(chunk)
            with self._cond:
                self._outbox.append(_Batch(EVENTS_TOPIC, payload, len(chunk)))

    def _deliver(self, final: bool) -> None:
        if not self._outbox:
            if final and self._in_flight:
                self._await_in_flight()
            return
        if self._bus_factory is None:
            with self._cond:
                self.counts["unsent"] += self._outbox_records
                self._outbox.clear()
                self._outbox_records = 0
            return
        if time.monotonic() < self._next_attempt and not final:
            return
        bus = self._connected_bus(final)
        if bus is None:
            return
        if isinstance(bus, TrackingBus):
            self._send_tracked(bus)
            if final:
                self._await_in_flight()
        else:
            self._send_and_flush(bus)

    def _next_batch(self) -> _Batch | None:
        with self._cond:
            if not self._outbox:
                return None
            batch = self._outbox.popleft()
            self._outbox_records -= batch.records
            self._in_flight.add(batch)
            self._in_flight_records += batch.records
            return batch

    def _unsend(self, batch: _Batch) -> None:
        """The bus refused ``batch`` outright: it was never sent, so it goes back first."""
        with self._cond:
            self._in_flight.discard(batch)
            self._in_flight_records -= batch.records
            self._outbox.appendleft(batch)
            self._outbox_records += batch.records

    def _count_sent(self, batch: _Batch) -> None:
        with self._cond:
            self.counts["sent"] += batch.records
            self.counts["batches_sent"] += 1
            if batch.attempts:
                self.counts["resent"] += batch.records
            batch.attempts += 1

    def _send_tracked(self, bus: TrackingBus) -> None:
        while (batch := self._next_batch()) is not None:
            self._count_sent(batch)
            try:
                bus.publish_tracked(
                    batch.topic, batch.payload, self._key, functools.partial(self._settled, batch)
                )
            except Exception as exc:
                with self._cond:  # not sent after all
                    self.counts["sent"] -= batch.records
                    self.counts["batches_sent"] -= 1
                    batch.attempts -= 1
                    if batch.attempts:
                        self.counts["resent"] -= batch.records
                self._unsend(batch)
                self._bus_failed(exc, close=False)
                return

    def _settled(self, batch: _Batch, error: BaseException | None) -> None:
        """The bus's verdict on one batch (on the bus's thread)."""
        with self._cond:
            if batch not in self._in_flight:
                return
            self._in_flight.discard(batch)
            self._in_flight_records -= batch.records
            if error is None:
                self.counts["acked"] += batch.records
                self.counts["batches_acked"] += 1
            else:
                self.counts["failed"] += batch.records
                self._outbox.appendleft(batch)  # retried first, keeping the rank's order
                self._outbox_records += batch.records
            self._cond.notify_all()
        if error is None:
            self._bus_ok()
        elif not self._stopping:  # failures while closing are reported as abandoned records
            self._bus_failed(error, close=False)

    def _await_in_flight(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(remaining)

    def _send_and_flush(self, bus: Bus) -> None:
        """For buses without per-message outcomes: a successful flush acknowledges the lot."""
        sent: list[_Batch] = []
        error: Exception | None = None
        while (batch := self._next_batch()) is not None:
            try:
                bus.publish(batch.topic, batch.payload, self._key)
            except Exception as exc:
                self._unsend(batch)
                error = exc
                break
            self._count_sent(batch)
            sent.append(batch)
        if sent:
            try:
                bus.flush(timeout_s=FLUSH_TIMEOUT_S)
            except Exception as exc:
                error = exc
                for batch in reversed(sent):
                    self._settled(batch, exc)
            else:
                for batch in sent:
                    self._settled(batch, None)
        if error is not None:
            self._bus_failed(error, close=True)

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
            self._bus_failed(exc, close=True)
            return None
        self.counts["connects"] += 1
        self.bus_up = True
        self._bus_logs_outages = isinstance(self._bus, TrackingBus)
        return self._bus

    def _bus_ok(self) -> None:
        self._backoff_s = self.backoff_initial_s
        self.bus_up = True
        self._outage.recovered(self.counts["dropped"])

    def _bus_failed(self, exc: BaseException, *, close: bool) -> None:
        """Back off; a bus that could not even be opened, or has no retry of its own, is
        closed and opened again later."""
        with self._cond:
            self.counts["bus_errors"] += 1
        # A tracking bus logs the outage of a broker it was connected to; not reaching the
        # broker at all is ours to say.
        bus_logs_it = self._bus_logs_outages and self._bus is not None and self.counts["acked"]
        self._outage.failed(exc, self.counts["dropped"], bus_logs_it=bool(bus_logs_it))
        self.bus_up = False
        if close:
            self._close_bus()
        now = time.monotonic()
        if now >= self._next_attempt:  # one step of backoff per attempt, not per failed batch
            self._next_attempt = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)

    def _close_bus(self) -> None:
        bus, self._bus = self._bus, None
        if bus is None or not self._owns_bus:
            return
        try:
            bus.close()
        except Exception as exc:
            self._guard.report("bus close", exc)

