"""The one outbound buffer of every producer: bounded, never blocking, every record counted.

The PyTorch producer (``attach()``), the host agent and the replay commands hand their records
to an :class:`Outbox`. Its daemon thread works like OpenTelemetry's ``BatchProcessor``: it wakes
when ``batch_records`` records wait or every ``flush_interval_s``, groups what waits per topic
and key (a rank's messages share a partition and stay in order), encodes bus messages of at
most ``batch_records`` rows, publishes them and counts what the bus acknowledged.

**One drop policy: drop the newest.** While ``capacity`` records are held (waiting to be sent,
or sent and not yet acknowledged), a new record is refused and counted as ``dropped``; nothing
already held is thrown away. Refusing at the door keeps :meth:`Outbox.offer` a constant-time
append that never waits; what is held is already encoded or on its way, and discarding it would
waste that work and punch holes into the middle of a rank's stream, where dropping the newest
leaves one gap at its end. While the bus is unreachable the held records are retried, oldest
first, with exponential backoff.

**"Published" means acknowledged by the bus.** On a bus that reports each message's outcome
(:class:`~trainscope.transport.protocol.TrackingBus`: Kafka) a record counts as ``acked`` when
the broker's acknowledgement arrives, and only what failed is sent again; on other buses (the
in-memory one) a successful ``flush`` acknowledges what was published before it.

The counts are in records and change under one lock, so they add up at any moment:

- ``submitted`` = ``acked`` + ``dropped`` + ``failed`` + ``queued``, where ``queued`` is what
  is held now (of it, ``in_flight`` was handed to the bus and awaits its verdict) and ``failed``
  was given up: no bus configured (``unsent``), or not acknowledged when the outbox closed
  (``abandoned``);
- ``sent`` (record sends handed to the bus; a retry counts again) = ``acked`` +
  ``send_failures`` + ``in_flight``. A failed send goes back to the front of the queue and is
  sent again (``resent``); a retry after a timeout may leave a duplicate on the topic, which the
  stream job drops by the batch's producer stamp.

Nothing raises into the caller: ``offer`` only appends under a lock, and everything that talks
to the bus runs on the outbox's thread, whose failures are reported (``report``) and survived.
A forked child holds nothing and has no thread (:meth:`Outbox.reset_after_fork`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from trainscope.schemas.codec import encode_batch
from trainscope.schemas.summaries import message_chunks
from trainscope.schemas.topics import EVENTS_TOPIC
from trainscope.transport.protocol import Bus, TrackingBus

log = logging.getLogger("trainscope.outbox")

# Rows per bus message (records, or the rows of a summary batch): large enough to amortise the
# per-message cost, small enough to stay far below Kafka's 1 MiB message limit with summaries of
# a few hundred bytes each.
DEFAULT_BATCH_RECORDS = 500
DEFAULT_CLOSE_TIMEOUT_S = 5.0

BusFactory = Callable[[], Bus]
Report = Callable[[str, BaseException], None]

COUNTS = (
    "submitted",  # records handed in, accepted or not
    "acked",  # records the bus acknowledged: published
    "dropped",  # records refused because ``capacity`` records were held (drop newest)
    "failed",  # records given up: ``unsent`` + ``abandoned`` (+ any that could not be encoded)
    "unsent",  # of ``failed``: no bus is configured, so nothing is ever sent
    "abandoned",  # of ``failed``: still held, or unacknowledged, when the outbox closed
    "sent",  # record sends handed to the bus; a retry counts again
    "send_failures",  # record sends the bus failed (each is retried unless the outbox closes)
    "resent",  # record sends that were retries
    "messages_sent",
    "messages_acked",
    "bytes_acked",
    "bus_errors",  # failures to open the bus, publish or flush (events, not records)
    "connects",
)


def _log_report(kind: str, exc: BaseException) -> None:
    log.warning("trainscope: %s failed (%s: %s)", kind, type(exc).__name__, exc)


@dataclass(eq=False, slots=True)
class _Message:
    topic: str
    key: bytes | None
    payload: bytes
    records: int
    attempts: int = 0


class OutageLog:
    """Telling the host process about a bus outage: once when it starts, once when it ends.

    A broker that is down for a minute makes every send fail many times over; the log should
    get a line when the bus goes away, a line when the queue starts dropping, and a line when
    the bus is back, with how much was dropped meanwhile. Thread-safe: failures are reported
    from the bus's thread as well as the outbox's.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._since: float | None = None  # monotonic start of the current outage
        self._dropped_at_start = 0
        self._drops_logged = False
        self._loud = False  # the start was logged as a warning here

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, exc: BaseException, dropped: int, *, bus_logs_it: bool) -> None:
        """A send or connection failed. ``bus_logs_it``: the bus itself logs this outage (a
        tracking bus that was connected), so this line is only INFO."""
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
            self._dropped_at_start = dropped
            self._drops_logged = False
            self._loud = not bus_logs_it
        log.log(
            logging.INFO if bus_logs_it else logging.WARNING,
            "trainscope: the bus is unreachable (%s: %s); records wait in a bounded queue (%d) "
            "and are dropped (counted) when it is full; retrying in the background (logged once "
            "until it is back)",
            type(exc).__name__,
            exc,
            self.capacity,
        )

    def dropping(self, dropped: int) -> None:
        """Called now and then with the drop count: the first drop of an outage is logged."""
        with self._lock:
            if self._since is None or self._drops_logged or dropped <= self._dropped_at_start:
                return
            self._drops_logged = True
        log.warning(
            "trainscope: the queue (%d records) is full while the bus is unreachable; new "
            "records are dropped and counted until it is back",
            self.capacity,
        )

    def recovered(self, dropped: int) -> None:
        """A send succeeded: an outage, if there was one, is over."""
        with self._lock:
            if self._since is None:
                return
            down_s = time.monotonic() - self._since
            lost = dropped - self._dropped_at_start
            loud = self._loud or lost > 0
            self._since = None
        log.log(
            logging.WARNING if loud else logging.INFO,
            "trainscope: the bus is back after %.1fs; held records are being delivered "
            "(%d dropped meanwhile because the queue was full)",
            down_s,
            lost,
        )


class Outbox:
    """The bounded queue between a producer and the bus, and the daemon thread that empties it.

    It owns the records handed in until the bus acknowledges them or they are given up, the
    thread that encodes and sends them, the counts of their fates (module docstring), the
    outage log, and the bus when ``owns_bus`` (it opens it through ``bus_factory`` on its thread,
    again after a failure, and closes it). Subclasses add work for the same thread by
    overriding :meth:`_gather`, which runs at the start of every round.
    """

    def __init__(
        self,
        bus_factory: BusFactory | None,
        *,
        owns_bus: bool = False,
        capacity: int,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        flush_interval_s: float = 0.5,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        key: bytes | None = None,
        name: str = "trainscope-outbox",
        report: Report | None = None,
    ) -> None:
        for what, value in (("capacity", capacity), ("batch_records", batch_records)):
            if value < 1:
                raise ValueError(f"{what} must be >= 1, got {value}")
        self._bus_factory = bus_factory
        # A bus object handed in by the caller is theirs to close; one we opened is ours.
        self._owns_bus = owns_bus
        self.capacity = capacity
        self.batch_records = batch_records
        self.flush_interval_s = flush_interval_s
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.key = key  # of the records :meth:`submit` takes, for ``EVENTS_TOPIC``
        self.name = name
        self._report = report or _log_report
        self.counts = dict.fromkeys(COUNTS, 0)
        self.bus_up = False
        self._init_state()

    def _init_state(self) -> None:
        self._cond = threading.Condition()
        self._submitted: list[Any] = []  # not encoded yet, from :meth:`submit`
        self._pending: list[tuple[str, bytes | None, Any]] = []  # not encoded yet, from offer
        self._messages: deque[_Message] = deque()  # encoded, waiting to be sent (or sent again)
        # Records held: accepted, and neither acknowledged, dropped nor failed yet; one number
        # so that the check on the training thread's path stays a single comparison.
        self._held = 0
        self._in_flight: set[_Message] = set()  # handed to the bus, outcome unknown
        self._in_flight_records = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False
        self._close_timeout_s = DEFAULT_CLOSE_TIMEOUT_S
        self._bus: Bus | None = None
        self._next_attempt = 0.0
        self._backoff_s = self.backoff_initial_s
        self._outage = OutageLog(self.capacity)
        self._bus_logs_outages = False  # a TrackingBus logs outages of a broker it reached

    # -- any thread ---------------------------------------------------------------------------
    def submit(self, record: Any) -> bool:
        """:meth:`offer` for ``EVENTS_TOPIC`` and this outbox's ``key``: the path a training
        thread takes once or more per step, so no more than an append under the lock."""
        with self._cond:
            counts = self.counts
            counts["submitted"] += 1
            if self._closed or self._held >= self.capacity:
                counts["dropped"] += 1
                return False
            self._held += 1
            submitted = self._submitted
            submitted.append(record)
            if len(submitted) >= self.batch_records:
                self._cond.notify()
        return True

    def offer(self, record: Any, key: bytes | None, topic: str = EVENTS_TOPIC) -> bool:
        """Take ``record`` for ``topic`` and ``key``, or drop and count it when full or closed;
        never blocks (beyond a short lock) and never raises."""
        with self._cond:
            self.counts["submitted"] += 1
            if self._closed or self._held >= self.capacity:
                self.counts["dropped"] += 1
                return False
            self._held += 1
            self._pending.append((topic, key, record))
            if len(self._pending) >= self.batch_records:
                self._cond.notify()
        return True

    def offer_many(
        self, records: Iterable[Any], key: bytes | None, topic: str = EVENTS_TOPIC
    ) -> int:
        """:meth:`offer` for each record, under one lock; returns how many were taken."""
        default_lane = topic == EVENTS_TOPIC and key == self.key
        taken = 0
        with self._cond:
            for record in records:
                self.counts["submitted"] += 1
                if self._closed or self._held >= self.capacity:
                    self.counts["dropped"] += 1
                    continue
                self._held += 1
                if default_lane:
                    self._submitted.append(record)
                else:
                    self._pending.append((topic, key, record))
                taken += 1
            if len(self._submitted) + len(self._pending) >= self.batch_records:
                self._cond.notify()
        return taken

    def offer_encoded(self, topic: str, key: bytes | None, payload: bytes, records: int) -> bool:
        """An already-encoded message of ``records`` records (e.g. an op trace); same bound."""
        with self._cond:
            self.counts["submitted"] += records
            if self._closed or self._held + records > self.capacity:
                self.counts["dropped"] += records
                return False
            self._held += records
            self._messages.append(_Message(topic, key, payload, records))
        return True

    def flush_soon(self) -> None:
        """Wake the thread now rather than at the end of its interval."""
        with self._cond:
            self._cond.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until nothing is held (all acknowledged, dropped or failed); ``False`` when
        ``timeout_s`` passed first. For commands and tests, never for a training thread."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify()
            while self._held:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                # Short waits: the thread does not notify for every state change.
                self._cond.wait(min(remaining, 0.05))
        return True

    def stats(self) -> dict[str, Any]:
        """The counts (module docstring) with ``queued``, ``in_flight`` and ``bus_up``."""
        with self._cond:
            out: dict[str, Any] = dict(self.counts)
            out["queued"] = self._held
            out["in_flight"] = self._in_flight_records
            out["bus_up"] = self.bus_up
        return out

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Send what can be sent within about ``timeout_s``, close the bus if it is ours, and
        give up on (count as failed) what is left; later offers are dropped. Never raises."""
        thread = self._thread
        with self._cond:
            if self._closed:
                return
            self._close_timeout_s = timeout_s
            self._stopping = True
            self._cond.notify()
        if thread is None:  # never started: the last round runs on the caller's thread
            self._run()
        else:
            thread.join(timeout_s + 1.0)
        self._thread = None

    def reset_after_fork(self) -> None:
        """In a forked child the thread is gone and the bus belongs to the parent."""
        self._init_state()
        self._stopping = self._closed = True

    # -- the outbox's thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._stopping:
                    self._cond.wait(self.flush_interval_s)
                final = self._stopping
            try:
                self._round(final)
            except Exception as exc:  # the thread must survive anything
                self._report("sender", exc)
            if final:
                break
        self._finish()

    def _round(self, final: bool) -> None:
        try:
            self._gather(final)
        except Exception as exc:
            self._report("sender round", exc)
        self._encode()
        self._deliver(final)
        self._outage.dropping(self.counts["dropped"])

    def _gather(self, final: bool) -> None:
        """Work of a subclass for this thread, run first in every round (``final``: the last
        one); it may :meth:`offer` what it made."""

    def _finish(self) -> None:
        self._close_bus()
        with self._cond:  # what is still held now will never be delivered: say so
            left = self._held
            self.counts["failed"] += left
            self.counts["abandoned"] += left
            # A send still in flight failed as far as we know: sent = acked + failures + in flight.
            self.counts["send_failures"] += self._in_flight_records
            self._submitted = []
            self._pending = []
            self._messages.clear()
            self._in_flight = set()
            self._held = self._in_flight_records = 0
            self._closed = True
            self._cond.notify_all()
        if left:
            log.warning("trainscope: %d records were not delivered before shutdown", left)

    def _encode(self) -> None:
        with self._cond:
            submitted, self._submitted = self._submitted, []
            pending, self._pending = self._pending, []
            taken = len(submitted) + len(pending)
            if not taken:
                return
            if self._bus_factory is None:  # nowhere to send: give up at once, unencoded
                self._give_up_unsent(taken)
                return
        lanes: dict[tuple[str, bytes | None], list[Any]] = {}
        if submitted:
            lanes[(EVENTS_TOPIC, self.key)] = submitted
        for topic, key, record in pending:
            lanes.setdefault((topic, key), []).append(record)
        for (topic, key), records in lanes.items():
            for chunk in message_chunks(records, self.batch_records):
                try:
                    payload = encode_batch(chunk)
                except Exception as exc:  # a record the codec refuses is lost, not retried
                    with self._cond:
                        self._held -= len(chunk)
                        self.counts["failed"] += len(chunk)
                    self._report("encode", exc)
                    continue
                with self._cond:
                    self._messages.append(_Message(topic, key, payload, len(chunk)))

    def _give_up_unsent(self, records: int) -> None:
        self._held -= records
        self.counts["failed"] += records
        self.counts["unsent"] += records

    def _deliver(self, final: bool) -> None:
        if not self._messages:
            if final and self._in_flight:
                self._await_in_flight()
            return
        if self._bus_factory is None:
            with self._cond:
                self._give_up_unsent(sum(m.records for m in self._messages))
                self._messages.clear()
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

    def _next_message(self) -> _Message | None:
        with self._cond:
            if not self._messages:
                return None
            message = self._messages.popleft()
            self._in_flight.add(message)
            self._in_flight_records += message.records
            return message

    def _unsend(self, message: _Message) -> None:
        """The bus refused ``message`` outright: it was never sent, so it goes back first."""
        with self._cond:
            self._in_flight.discard(message)
            self._in_flight_records -= message.records
            self._messages.appendleft(message)

    def _count_sent(self, message: _Message, sign: int = 1) -> None:
        """Count a send (``sign`` -1: take back one the bus refused outright)."""
        with self._cond:
            if sign < 0:
                message.attempts -= 1
            self.counts["sent"] += sign * message.records
            self.counts["messages_sent"] += sign
            if message.attempts:
                self.counts["resent"] += sign * message.records
            if sign > 0:
                message.attempts += 1

    def _send_tracked(self, bus: TrackingBus) -> None:
        while (message := self._next_message()) is not None:
            self._count_sent(message)
            try:
                bus.publish_tracked(
                    message.topic,
                    message.payload,
                    message.key,
                    functools.partial(self._settled, message),
                )
            except Exception as exc:  # not sent after all
                self._count_sent(message, -1)
                self._unsend(message)
                self._bus_failed(exc, close=False)
                return

    def _settled(self, message: _Message, error: BaseException | None) -> None:
        """The bus's verdict on one message (on the bus's thread, or ours)."""
        with self._cond:
            if message not in self._in_flight:
                return
            self._in_flight.discard(message)
            self._in_flight_records -= message.records
            if error is None:
                self._held -= message.records
                self.counts["acked"] += message.records
                self.counts["messages_acked"] += 1
                self.counts["bytes_acked"] += len(message.payload)
            else:
                self.counts["send_failures"] += message.records
                self._messages.appendleft(message)  # retried first, keeping the rank's order
            self._cond.notify_all()
        if error is None:
            self._bus_ok()
        elif not self._stopping:  # failures while closing are reported as abandoned records
            self._bus_failed(error, close=False)

    def _await_in_flight(self) -> None:
        deadline = time.monotonic() + self._close_timeout_s
        with self._cond:
            while self._in_flight and (remaining := deadline - time.monotonic()) > 0:
                self._cond.wait(remaining)

    def _send_and_flush(self, bus: Bus) -> None:
        """For buses without per-message outcomes: a successful flush acknowledges the lot."""
        sent: list[_Message] = []
        error: Exception | None = None
        while (message := self._next_message()) is not None:
            try:
                bus.publish(message.topic, message.payload, message.key)
            except Exception as exc:
                self._unsend(message)
                error = exc
                break
            self._count_sent(message)
            sent.append(message)
        if sent:
            try:
                bus.flush(timeout_s=self._close_timeout_s)
            except Exception as exc:
                error = exc
                for message in reversed(sent):
                    self._settled(message, exc)
            else:
                for message in sent:
                    self._settled(message, None)
        if error is not None:
            self._bus_failed(error, close=True)

    def _connected_bus(self, final: bool) -> Bus | None:
        if self._bus is not None:
            return self._bus
        if time.monotonic() < self._next_attempt and not final:
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
        if now >= self._next_attempt:  # one step of backoff per attempt, not per failed message
            self._next_attempt = now + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)

    def _close_bus(self) -> None:
        bus, self._bus = self._bus, None
        if bus is None or not self._owns_bus:
            return
        try:
            bus.close()
        except Exception as exc:
            self._report("bus close", exc)
