"""The Kafka bus: the :class:`~trainscope.streams.bus.Bus` protocol on top of aiokafka.

``publish`` never waits for the network: it appends to a bounded queue that the bus's event
loop hands to the aiokafka producer, which batches (``linger_ms``) and compresses per partition.
When the queue is full (the broker is slow or gone) ``publish`` raises :class:`BusError` at once,
so a training process can drop and count instead of stalling. ``flush`` waits for delivery and
reports, as ``BusError``, both a timeout and every message that could not be delivered.
Messages are keyed (``job/rank``) so that one rank's messages share a partition and stay in order.
Topics are created with ``partitions`` partitions before first use; an existing topic is kept.
"""

from __future__ import annotations

import asyncio
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

from trainscope.streams._kafka_outbox import Outbox
from trainscope.streams._kafka_support import (
    EventLoopThread,
    create_topics,
    split_servers,
    start_client,
)
from trainscope.streams.bus_protocol import DEFAULT_PARTITIONS, BusError
from trainscope.streams.kafka_consumer import KafkaConsumer, start_consumer

log = logging.getLogger(__name__)

# Kafka's default per-message limit (message.max.bytes); larger messages fail at the broker.
MAX_MESSAGE_BYTES = 1024 * 1024
COMPRESSIONS = ("gzip", "lz4", "snappy", "zstd", None)
# After a failed connection, publish fails fast for this long instead of queueing
# messages that cannot go anywhere; the next publish after it tries to connect again.
RECONNECT_BACKOFF_S = 1.0
CALL_GRACE_S = 5.0


class KafkaBus:
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
    ) -> None:
        self._servers = split_servers(bootstrap_servers)
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
        self._outbox = Outbox(
            self.bootstrap_servers,
            max_pending,
            max_pending_bytes,
            MAX_MESSAGE_BYTES,
            on_trouble=self._forget_topics,
        )
        self.counts = self._outbox.counts
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

    def __repr__(self) -> str:
        return f"KafkaBus({self.bootstrap_servers!r})"

    # -- publishing -----------------------------------------------------------------------

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self._closed:
            raise BusError(f"publish on a closed bus ({self.bootstrap_servers})")
        if self._outbox.offer(topic, value, key):
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
        while (item := self._outbox.take()) is not None:
            topic, value, key = item
            try:
                producer = await self._producer_ready()
                await self._ensure_topics([topic])
                delivery = await producer.send(topic, value, key=key)
            except Exception as exc:
                self._outbox.settle(len(value), exc)
                if self._producer is None:  # could not connect: fail the rest fast too
                    self._outbox.fail_queued(exc)
                continue
            delivery.add_done_callback(functools.partial(self._outbox.settle, len(value)))

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
            await start_client(client, self.bootstrap_servers)
        except BusError as exc:
            self._outbox.mark_down(str(exc), RECONNECT_BACKOFF_S)
            raise

    async def _admin_ready(self) -> AIOKafkaAdminClient:
        async with self._start_lock:
            if self._admin is None:
                admin = AIOKafkaAdminClient(
                    bootstrap_servers=self.bootstrap_servers,
                    client_id=self.client_id,
                    request_timeout_ms=self.request_timeout_ms,
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

    def consumer(self, topics: list[str], group: str) -> KafkaConsumer:
        if not topics:
            raise ValueError("a consumer needs at least one topic")
        thread = self._loop()
        timeout_s = self.request_timeout_ms / 1000 + CALL_GRACE_S
        consumer = thread.run(
            self._open_consumer(list(topics), group),
            timeout_s,
            self._what(f"subscribe {group!r} to {topics}"),
        )
        wrapper = KafkaConsumer(consumer, thread, self.bootstrap_servers, timeout_s)
        self._consumers.add(wrapper)
        return wrapper

    async def _open_consumer(self, topics: list[str], group: str) -> Any:
        await self._ensure_topics(topics)
        return await start_consumer(
            topics,
            group,
            bootstrap_servers=self.bootstrap_servers,
            client_id=self.client_id,
            session_timeout_ms=self.session_timeout_ms,
            request_timeout_ms=self.request_timeout_ms,
        )

    # -- shutdown -------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Deliver what is pending, close the consumers, stop; within about ``timeout_s``.

        Undelivered messages are logged (and stay counted as pending), never raised: closing
        happens on shutdown paths that must not fail.
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

    async def _stop_clients(self, timeout_s: float = 1.0) -> None:
        # A producer stop waits for undeliverable batches to expire; do not wait that long.
        for client in (self._producer, self._admin):
            if client is not None:
                stop = client.stop if isinstance(client, AIOKafkaProducer) else client.close
                try:
                    await asyncio.wait_for(stop(), timeout_s)
                except Exception as exc:
                    log.debug("stopping %s: %r", type(client).__name__, exc)
