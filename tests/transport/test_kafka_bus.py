"""KafkaBus behaviour that has no in-memory counterpart: failures, compression, recovery."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from aiokafka.codec import has_lz4
from kafka_broker import TansuBroker, free_port

from trainscope.schemas import StepRecord, encode_batch
from trainscope.transport.bus import BusError, open_bus
from trainscope.transport.kafka import KafkaBus

pytestmark = pytest.mark.kafka


def unique(prefix: str) -> str:
    return f"test.{prefix}.{uuid.uuid4().hex[:10]}"


def wait_for_value(bus: KafkaBus, topic: str, value: bytes, timeout_s: float = 15.0) -> bool:
    consumer = bus.consumer([topic], unique("group"))
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(m.value == value for m in consumer.poll(timeout_s=0.2)):
                return True
        return False
    finally:
        consumer.close()


def test_open_bus_returns_a_kafka_bus(kafka_broker: TansuBroker) -> None:
    bus = open_bus(kafka_broker.url)
    try:
        assert isinstance(bus, KafkaBus)
        assert bus.bootstrap_servers == kafka_broker.bootstrap_servers
    finally:
        bus.close()


def test_unreachable_broker_fails_fast_naming_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    bus = KafkaBus(address)
    try:
        started = time.monotonic()
        with pytest.raises(BusError, match=rf"cannot reach Kafka at {address}: connection refused"):
            bus.consumer([unique("t")], unique("group"))
        with pytest.raises(BusError, match=rf"cannot reach Kafka at {address}: connection refused"):
            bus.connect()
        try:
            bus.publish(unique("t"), b"x")
        except BusError as exc:  # allowed: the failed connect is still fresh
            assert address in str(exc)
        else:
            with pytest.raises(BusError, match=address):
                bus.flush(timeout_s=30)
        assert time.monotonic() - started < 5
        assert bus.counts["delivered"] == 0
    finally:
        bus.close()


def test_invalid_arguments_are_rejected_early() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        KafkaBus("127.0.0.1:notaport")
    with pytest.raises(ValueError, match="compression"):
        KafkaBus("127.0.0.1:9092", compression="brotli")
    with pytest.raises(ValueError, match="max_pending"):
        KafkaBus("127.0.0.1:9092", max_pending=0)


class ByteCountingProxy:
    """Forwards 127.0.0.1:port to the broker and counts the bytes clients send."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.client_bytes = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, count: bool) -> None:
        try:
            while chunk := source.recv(65536):
                if count:
                    with self._lock:
                        self.client_bytes += len(chunk)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._server.close()


@pytest.fixture
def proxied_broker() -> Iterator[tuple[TansuBroker, ByteCountingProxy]]:
    broker_port = free_port()
    proxy = ByteCountingProxy(broker_port)
    # The broker advertises the proxy, so every connection of the client goes through it.
    with TansuBroker(broker_port, advertised_port=proxy.port) as broker:
        yield broker, proxy
    proxy.close()


def test_messages_are_compressed_on_the_wire(
    proxied_broker: tuple[TansuBroker, ByteCountingProxy],
) -> None:
    broker, proxy = proxied_broker
    bus = KafkaBus(broker.bootstrap_servers)
    assert bus.compression == ("lz4" if has_lz4() else "gzip")
    topic = unique("compressed")
    try:
        bus.connect([topic])
        records = [
            StepRecord(job_id="job-c", rank=0, step=s, start_ns=s * 10**9, duration_ns=10**9)
            for s in range(4000)
        ]
        payload = encode_batch(records)
        before = proxy.client_bytes
        for _ in range(5):
            bus.publish(topic, payload, key=b"job-c/0")
        bus.flush(10)
        sent = proxy.client_bytes - before
    finally:
        bus.close()
    assert len(payload) > 100_000
    # Uncompressed, the wire would carry at least 5 * len(payload) bytes.
    assert sent < len(payload), f"{sent} bytes on the wire for 5 x {len(payload)} bytes"


def test_oversized_message_is_rejected_at_publish(kafka_broker: TansuBroker) -> None:
    bus = KafkaBus(kafka_broker.bootstrap_servers)
    try:
        with pytest.raises(BusError, match="exceeds"):
            bus.publish(unique("big"), b"x" * (2 * 1024 * 1024))
        assert bus.counts["rejected"] == 1
    finally:
        bus.close()


def test_broker_outage_raises_then_recovers(fresh_kafka_broker: TansuBroker) -> None:
    broker = fresh_kafka_broker
    bus = KafkaBus(broker.bootstrap_servers, max_pending=50, session_timeout_ms=2_000)
    topic = unique("outage")
    try:
        bus.publish(topic, b"before", key=b"k")
        bus.flush(10)

        broker.stop()
        started = time.monotonic()
        with pytest.raises(BusError, match="pending"):
            for _ in range(10_000):
                bus.publish(topic, b"during", key=b"k")
        with pytest.raises(BusError, match=rf"timed out.*{broker.bootstrap_servers}"):
            bus.flush(timeout_s=1.0)
        assert time.monotonic() - started < 3
        assert bus.counts["rejected"] >= 1

        broker.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                bus.publish(topic, b"after", key=b"k")
                bus.flush(5)
                break
            except BusError:
                if time.monotonic() > deadline:
                    raise
        # The restarted test broker is empty; what counts is that new messages arrive.
        assert wait_for_value(bus, topic, b"after")
    finally:
        started = time.monotonic()
        bus.close()
        assert time.monotonic() - started < 15
