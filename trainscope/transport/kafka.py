"""The Kafka bus: the :class:`~trainscope.transport.bus.Bus` protocol on top of aiokafka.

``publish`` never waits for the network: it appends to a bounded queue that the bus's event
loop hands to the aiokafka producer, which batches (``linger_ms``) and compresses per partition.
When the queue is full (the broker is slow or gone) ``publish`` raises :class:`BusError` at once,
so a training process can drop and count instead of stalling. ``flush`` waits for delivery and
reports, as ``BusError``, both a timeout and every message that could not be delivered.
Messages are keyed (``job/rank``) so that one rank's messages share a partition and stay in order.
Topics are created with ``partitions`` partitions before first use; an existing topic is kept.

``publish_tracked`` reports each message's outcome. While messages wait unusually long the bus
checks whether the broker is reachable at all; if not, it gives up on the producer and fails
what it held (the caller keeps and retries them), and reconnects — re-creating the topics, which
a replaced broker may have lost — on the next publish after a short backoff. An outage is
logged once when it starts and once when it ends; aiokafka's own per-retry log lines are
silenced unless the ``aiokafka`` logger was configured explicitly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from typing import Any

try:
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.codec import has_lz4
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "the Kafka bus needs aiokafka: pip install 'trainscope[host]' or 'trainscope[stream]'"
    ) from exc

from trainscope.transport import aiokafka_private
from trainscope.transport.kafka_consumer import KafkaConsumer, start_consumer
from trainscope.transport.kafka_group import KeepPositions, SoleMemberAssignor
from trainscope.transport.kafka_pending import Entry, PendingMessages
from trainscope.transport.kafka_support import (
    EventLoopThread,
    create_topics,
    fail_pending,
    split_servers,
    start_client,
    why_unreachable,
)
from trainscope.transport.protocol import DEFAULT_PARTITIONS, BusError, DeliveryCallback
from trainscope.transport.security import KafkaSecurity, parse_kafka_url

log = logging.getLogger(__name__)

# Kafka's default per-message limit (message.max.bytes); larger messages fail at the broker.
MAX_MESSAGE_BYTES = 1024 * 1024
COMPRESSIONS = ("gzip", "lz4", "snappy", "zstd", None)
# After a failed connection, publish fails fast for this long instead of queueing
# messages that cannot go anywhere; the next publish after it tries to connect again.
RECONNECT_BACKOFF_S = 1.0
CALL_GRACE_S = 5.0
# A message unacknowledged for this long makes the bus check that the broker is reachable.
STALL_CHECK_S = 1.0
WATCH_INTERVAL_S = 0.25


def _quiet_client_library() -> None:
    """aiokafka logs every failed connection attempt (about a hundred lines a second while a
    broker is down) into whatever process hosts the bus, training jobs included. The bus logs
    an outage itself, once; a user who set the ``aiokafka`` logger's level keeps it."""
    library = logging.getLogger("aiokafka")
    if library.level == logging.NOTSET:
        library.setLevel(logging.CRITICAL)


class KafkaBus:
    """The bus over a Kafka cluster (or any Kafka-protocol broker, Tansu included), for callers
    that are not asyncio: a training process, the host agent, the stream job, the commands.

    It owns one event loop on a daemon thread of its own (started on first use; a forked child
    must open its own bus), and on that loop an aiokafka producer and admin client (connected
    on first publish or :meth:`connect`, replaced after an outage), the outbox of messages not
    yet handed to the producer, and every :class:`KafkaConsumer` it opened, which
    :meth:`close` closes.

    Guarantees: ``publish`` never waits on the network (a full outbox raises ``BusError`` at
    once); the messages of one key go to one partition; ``publish_tracked``'s callback runs
    exactly once per message; ``flush`` and ``close`` return within about their timeout; a
    producer given up during an outage has its batches failed, so a message reported failed is
    not also delivered later by it.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        client_id: str = "trainscope",
        linger_ms: int = 5,
        compression: str | None = "lz4",
        partitions: int = DEFAULT_PARTITIONS,
        replication_factor: int = 1,
        max_pending: int = 10_000,
        max_pending_bytes: int = 64 * 1024 * 1024,
        request_timeout_ms: int = 10_000,
        session_timeout_ms: int = 6_000,
        security: KafkaSecurity | None = None,
    ) -> None:
        self._servers = split_servers(bootstrap_servers)
        # TLS/SASL for every client of this bus; without an argument, from the environment.
        self.security = security if security is not None else KafkaSecurity.resolve()
        self._client_kwargs = self.security.client_kwargs()  # reads the TLS files: fail early
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        for name, value in (
            ("partitions", partitions),
            ("max_pending", max_pending),
            ("replication_factor", replication_factor),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.bootstrap_servers = ",".join(f"{h}:{p}" for h, p in self._servers)
        self.client_id = client_id
        self.linger_ms = linger_ms
        # aiokafka's lz4/snappy/zstd codecs come from cramjam (the aiokafka[lz4] extra).
        lz4_family = compression not in (None, "gzip")
        self.compression = "gzip" if lz4_family and not has_lz4() else compression
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.request_timeout_ms = request_timeout_ms
        # A group (re)join waits on the order of the session timeout (half of it on Tansu), so
        # keep it short; 6 s is the smallest a stock Kafka broker accepts.
        self.session_timeout_ms = session_timeout_ms
        self._outbox = PendingMessages(
            self.bootstrap_servers,
            max_pending,
            max_pending_bytes,
            MAX_MESSAGE_BYTES,
            on_trouble=self._forget_topics,
        )
        self.counts = self._outbox.counts
        self._in_flight: set[Entry] = set()  # handed to the current producer, not settled
        self._watching = False
        self._outage_since: float | None = None  # monotonic start of the current outage
        self._connected_once = False
        _quiet_client_library()
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._thread: EventLoopThread | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._start_lock = asyncio.Lock()
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._topics_ready: set[str] = set()
        self._consumers: weakref.WeakSet[KafkaConsumer] = weakref.WeakSet()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> KafkaBus:
        """``kafka://HOST:PORT[,HOST:PORT...][?security settings]``, see :mod:`kafka_security`."""
        servers, security = parse_kafka_url(url)
        return cls(servers, security=security, **options)

    def __repr__(self) -> str:
        return f"KafkaBus({self.bootstrap_servers!r}, {self.security.describe()})"

    # -- publishing -----------------------------------------------------------------------

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self._offer(topic, value, key, None)

    def publish_tracked(
        self, topic: str, value: bytes, key: bytes | None, on_done: DeliveryCallback
    ) -> None:
        """Queue a message; ``on_done(None)`` once Kafka acknowledged it, ``on_done(error)``
        when it failed (on the bus's thread, exactly once). Raises ``BusError`` when the
        message cannot even be queued (bus full, broker just found unreachable)."""
        self._offer(topic, value, key, on_done)

    def _offer(
        self, topic: str, value: bytes, key: bytes | None, on_done: DeliveryCallback | None
    ) -> None:
        if self._closed:
            raise BusError(f"publish on a closed bus ({self.bootstrap_servers})")
        if self._outbox.offer(topic, value, key, on_done):
            self._loop().call_soon(self._start_drain)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for every published message; ``BusError`` on timeout or failed deliveries."""
        if self._producer is not None and self._thread is not None:
            self._thread.call_soon(self._start_producer_flush)
        self._outbox.wait_settled(timeout_s)

    def connect(self, topics: list[str] | tuple[str, ...] = (), timeout_s: float = 10.0) -> None:
        """Connect and create ``topics`` now; publishing would do it lazily in the background.

        For command-line tools that should fail at once, with a clear ``BusError``, when the
        broker cannot be reached.
        """
        self._loop().run(self._connect(list(topics)), timeout_s, self._what("connect"))

    async def _connect(self, topics: list[str]) -> None:
        await self._producer_ready()
        await self._ensure_topics(topics)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

    def _start_drain(self) -> None:
        self._spawn(self._drain())

    def _start_producer_flush(self) -> None:
        if self._producer is not None:
            self._spawn(self._producer.flush())

    async def _drain(self) -> None:
        while (entry := self._outbox.take()) is not None:
            try:
                producer = await self._producer_ready()
                await self._ensure_topics([entry.topic])
                delivery = await producer.send(entry.topic, entry.value, key=entry.key)
            except asyncio.CancelledError:  # the bus is closing
                self._outbox.settle(entry, BusError("the bus closed before sending"))
                raise
            except Exception as exc:
                self._outbox.settle(entry, exc)
                if self._producer is None:  # could not connect: fail the rest fast too
                    self._outbox.fail_queued(exc)
                continue
            self._in_flight.add(entry)
            delivery.add_done_callback(functools.partial(self._delivered, entry))
            if not self._watching:
                self._watching = True
                self._spawn(self._watch())

    def _delivered(self, entry: Entry, delivery: asyncio.Future[Any]) -> None:
        self._in_flight.discard(entry)
        self._outbox.settle(entry, delivery)

    async def _watch(self) -> None:
        """While messages are in flight: if one waits long, is the broker reachable at all?"""
        try:
            while self._in_flight and not self._closed:
                await asyncio.sleep(WATCH_INTERVAL_S)
                oldest = min((e.sent_at for e in self._in_flight), default=time.monotonic())
                if time.monotonic() - oldest < STALL_CHECK_S:
                    continue
                # A slow broker is not an outage: only an unreachable one is.
                reason = await why_unreachable(self._servers, self.security)
                if reason:
                    self._abandon_producer(reason)
                    return
                await asyncio.sleep(STALL_CHECK_S)  # reachable: do not probe it continuously
        finally:
            self._watching = False

    def _abandon_producer(self, reason: str) -> None:
        """The broker is gone: fail what the producer holds (callers retry it) and reconnect,
        topics included, once it is back; aiokafka alone would keep the messages and, after a
        broker replacement, could hand them to a broker that no longer has their topic."""
        error = BusError(f"cannot reach Kafka at {self.bootstrap_servers}: {reason}")
        self._outage_started(str(error))
        producer, admin = self._producer, self._admin
        self._producer = self._admin = None
        self._topics_ready.clear()
        self._outbox.mark_down(str(error), RECONNECT_BACKOFF_S)
        if producer is not None:
            fail_pending(producer, error)  # so that it never sends them after all
        for entry in list(self._in_flight):
            self._outbox.settle(entry, error)
        self._in_flight.clear()
        self._outbox.fail_queued(error)
        self._spawn(self._stop_given_up(producer, admin))

    async def _stop_given_up(self, *clients: Any) -> None:
        for client in clients:
            if client is None:
                continue
            stop = client.stop if isinstance(client, AIOKafkaProducer) else client.close
            try:
                await asyncio.wait_for(stop(), 1.0)
            except Exception as exc:
                log.debug("stopping %s: %r", type(client).__name__, exc)
                # A producer whose batches were failed may trip over its own bookkeeping while
                # stopping; still close its connections and metadata task.
                try:
                    connections = aiokafka_private.network_client(client)
                except aiokafka_private.AiokafkaPrivateApiError as error:
                    aiokafka_private.warn_once(error)  # the client is given up either way
                    continue
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(connections.close(), 1.0)

    def _outage_started(self, reason: str) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            # Never reaching the broker is an error the caller reports; losing it is news.
            level = logging.WARNING if self._connected_once else logging.DEBUG
            log.log(level, "%s; retrying in the background (logged once until it is back)", reason)

    def _outage_ended(self) -> None:
        if self._outage_since is not None:
            log.log(
                logging.WARNING if self._connected_once else logging.INFO,
                "Kafka at %s is reachable again after %.1fs",
                self.bootstrap_servers,
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None

    def _forget_topics(self) -> None:
        # The broker may have been replaced and lost them; creating an existing topic is
        # harmless.
        self._topics_ready.clear()

    # -- connections ----------------------------------------------------------------------

    def _loop(self) -> EventLoopThread:
        if os.getpid() != self._pid:
            raise BusError("a KafkaBus cannot be used in a forked child; open a new bus there")
        with self._lock:
            if self._thread is None:
                self._thread = EventLoopThread(f"trainscope-kafka-{self.client_id}")
            return self._thread

    def _what(self, action: str) -> str:
        return f"{action} on Kafka at {self.bootstrap_servers}"

    async def _start_client(self, client: Any) -> None:
        try:
            await start_client(client, self.bootstrap_servers, self.security)
        except BusError as exc:
            self._outbox.mark_down(str(exc), RECONNECT_BACKOFF_S)
            self._outage_started(str(exc))
            raise
        self._outage_ended()
        self._connected_once = True

    async def _admin_ready(self) -> AIOKafkaAdminClient:
        async with self._start_lock:
            if self._admin is None:
                admin = AIOKafkaAdminClient(
                    bootstrap_servers=self.bootstrap_servers,
                    client_id=self.client_id,
                    request_timeout_ms=self.request_timeout_ms,
                    **self._client_kwargs,
                )
                await self._start_client(admin)
                self._admin = admin
        return self._admin

    async def _producer_ready(self) -> AIOKafkaProducer:
        await self._admin_ready()
        async with self._start_lock:
            if self._producer is None:
                producer = AIOKafkaProducer(
                    bootstrap_servers=self.bootstrap_servers,
                    client_id=self.client_id,
                    acks="all",
                    enable_idempotence=False,  # not supported by every Kafka-protocol broker
                    linger_ms=self.linger_ms,
                    compression_type=self.compression,
                    max_batch_size=MAX_MESSAGE_BYTES,
                    max_request_size=MAX_MESSAGE_BYTES + 64 * 1024,
                    request_timeout_ms=self.request_timeout_ms,
                    **self._client_kwargs,
                )
                await self._start_client(producer)
                self._producer = producer
        return self._producer

    async def _ensure_topics(self, topics: list[str]) -> None:
        missing = [t for t in dict.fromkeys(topics) if t not in self._topics_ready]
        if missing:
            admin = await self._admin_ready()
            await create_topics(admin, missing, self.partitions, self.replication_factor)
            self._topics_ready.update(missing)

    # -- consuming ------------------------------------------------------------------------

    def consumer(
        self, topics: list[str], group: str, *, sole_member: bool = False
    ) -> KafkaConsumer:
        """A member of ``group`` reading ``topics``. ``sole_member``: the group's partitions
        all go to one member, never split (see :mod:`trainscope.transport.kafka_group`); this
        member's ``poll`` raises ``GroupHeldElsewhere`` if another member holds them."""
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        thread = self._loop()
        timeout_s = self.request_timeout_ms / 1000 + CALL_GRACE_S
        listener = KeepPositions()
        assignor = SoleMemberAssignor() if sole_member else None
        consumer = thread.run(
            self._open_consumer(list(topics), group, listener, assignor),
            timeout_s,
            self._what(f"subscribe {group!r} to {topics}"),
        )
        wrapper = KafkaConsumer(
            consumer, thread, self.bootstrap_servers, timeout_s,
            group=group, listener=listener, assignor=assignor,
        )
        self._consumers.add(wrapper)
        return wrapper

    async def _open_consumer(
        self,
        topics: list[str],
        group: str,
        listener: KeepPositions,
        assignor: SoleMemberAssignor | None,
    ) -> Any:
        await self._ensure_topics(topics)
        return await start_consumer(
            topics,
            group,
            bootstrap_servers=self.bootstrap_servers,
            client_id=self.client_id,
            session_timeout_ms=self.session_timeout_ms,
            request_timeout_ms=self.request_timeout_ms,
            security=self.security,
            client_kwargs=self._client_kwargs,
            listener=listener,
            assignor=assignor,
        )

    # -- shutdown -------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is pending, close the consumers, stop; within about ``timeout_s``.

        Undelivered messages are logged and counted (and reported) as failed, never raised:
        closing happens on shutdown paths that must not fail.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is None or os.getpid() != self._pid:
            return
        deadline = time.monotonic() + timeout_s
        try:
            self.flush(timeout_s)
        except BusError as exc:
            log.warning("closing the Kafka bus: %s", exc)
        for consumer in list(self._consumers):
            consumer.close()
        remaining_s = max(deadline - time.monotonic(), 1.0)
        try:
            self._thread.run(self._stop_clients(), remaining_s + 1.0, self._what("close"))
        except BusError as exc:
            log.warning("%s", exc)
        self._thread.stop()
        # Whatever is still unsettled will never be delivered by this bus: say so.
        gone = BusError(f"bus to Kafka at {self.bootstrap_servers} closed before delivery")
        for entry in list(self._in_flight):
            self._outbox.settle(entry, gone)
        self._in_flight.clear()
        self._outbox.fail_queued(gone)

    async def _stop_clients(self, timeout_s: float = 1.0) -> None:
        # A producer stop waits for undeliverable batches to expire; do not wait that long.
        if self._producer is not None and self._in_flight:
            fail_pending(self._producer, BusError("the bus is closing"))
        current = asyncio.current_task()
        for task in list(self._tasks):  # the watchdog, drains, stops of given-up clients
            if task is not current:
                task.cancel()
        for client in (self._producer, self._admin):
            if client is not None:
                stop = client.stop if isinstance(client, AIOKafkaProducer) else client.close
                try:
                    await asyncio.wait_for(stop(), timeout_s)
                except Exception as exc:
                    log.debug("stopping %s: %r", type(client).__name__, exc)
