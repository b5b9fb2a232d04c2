"""Support for the Kafka bus: the background event loop, starting clients, diagnostics.

aiokafka is asyncio-only while the bus's callers (a training process, the pipeline runner, a
CLI) are synchronous, so each bus owns one event loop on a daemon thread and hands it
coroutines. Nothing here blocks the caller for longer than the timeout it passes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import ssl
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from trainscope.transport import aiokafka_private
from trainscope.transport.protocol import BusError
from trainscope.transport.security import KafkaSecurity

T = TypeVar("T")
log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
TOPIC_EXISTS = 36


class EventLoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float, what: str) -> T:
        """Run ``coro`` on the loop and wait; ``BusError`` if it takes longer than ``timeout_s``."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise BusError(f"{what}: blocking bus call from the bus's own event loop")
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise BusError(f"{what} timed out after {timeout_s:g}s") from None

    def call_soon(self, callback: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(callback, *args)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


def split_servers(bootstrap_servers: str) -> list[tuple[str, int]]:
    """``"h1:9092,h2"`` → ``[("h1", 9092), ("h2", 9092)]``; ``ValueError`` names a bad entry."""
    out: list[tuple[str, int]] = []
    for entry in bootstrap_servers.split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep:
            host, port = entry, "9092"
        if not host or not port.isdigit():
            raise ValueError(f"bad Kafka server address {entry!r}: expected HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError(f"no Kafka server in {bootstrap_servers!r}: expected HOST:PORT[,...]")
    return out


async def why_unreachable(
    servers: list[tuple[str, int]], security: KafkaSecurity | None = None
) -> str | None:
    """Why no server accepts a connection (``None`` if one does), TLS handshake included.

    aiokafka only says "Unable to bootstrap"; the operator needs "connection refused" versus
    "unknown host" versus "timed out" versus "certificate verify failed" to know whether the
    broker is down, misnamed, firewalled or not trusted.
    """
    context = security.ssl_context() if security is not None and security.uses_tls else None
    reasons: list[str] = []
    for host, port in servers:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        except TimeoutError:
            reasons.append("connection timed out")
        except ConnectionRefusedError:
            reasons.append("connection refused")
        except socket.gaierror:
            reasons.append(f"unknown host {host!r}")
        except OSError as exc:
            reasons.append(exc.strerror or str(exc))
        else:
            writer.close()
            if context is None:
                return None
            assert security is not None
            problem = await _tls_problem(host, port, context, security)
            if problem is None:
                return None
            reasons.append(problem)
    return "; ".join(dict.fromkeys(reasons))


async def _tls_problem(
    host: str, port: int, context: ssl.SSLContext, security: KafkaSecurity
) -> str | None:
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=context, server_hostname=host),
            PROBE_TIMEOUT_S,
        )
    except ssl.SSLCertVerificationError as exc:
        reason = exc.verify_message or exc.reason or "certificate verify failed"
        return (
            f"Kafka TLS handshake with {host}:{port} failed: certificate verify failed: "
            f"{reason} ({_trust(security)})"
        )
    except ssl.SSLError as exc:
        return f"Kafka TLS handshake with {host}:{port} failed: {exc.reason or exc}"
    except (OSError, TimeoutError) as exc:
        what = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return f"Kafka TLS handshake with {host}:{port} failed: {what}"
    writer.close()
    return None


def _trust(security: KafkaSecurity) -> str:
    return f"CA file {security.ssl_cafile}" if security.ssl_cafile else "the system's CA store"


async def start_client(
    client: Any, bootstrap_servers: str, security: KafkaSecurity | None = None
) -> None:
    """Start an aiokafka client; ``BusError`` naming the servers and the reason if it cannot."""
    try:
        await client.start()
    except Exception as exc:
        close = getattr(client, "stop", None) or client.close
        try:
            await close()
        except Exception:
            log.debug("closing a client that failed to start", exc_info=True)
        reason = await why_unreachable(split_servers(bootstrap_servers), security)
        if not reason and security is not None and security.uses_sasl:
            # The connection and the TLS handshake work, so the broker refused the login or the
            # mechanism (aiokafka reports either only as a failure to bootstrap).
            reason = (
                f"the broker refused the SASL login ({security.describe()}): check the user "
                f"name, password and mechanism"
            )
        raise BusError(
            f"cannot reach Kafka at {bootstrap_servers}: {reason or _one_line(exc)}"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


async def create_topics(
    admin: AIOKafkaAdminClient, topics: list[str], partitions: int, replication_factor: int
) -> None:
    """Create ``topics`` explicitly (auto-created ones get the broker's partition count)."""
    response = await admin.create_topics(
        [NewTopic(t, partitions, replication_factor) for t in topics]
    )
    for topic, code, *detail in response.topic_errors:
        if code not in (0, TOPIC_EXISTS):
            raise BusError(f"cannot create topic {topic!r}: Kafka error {code} {detail}")


def fail_pending(producer: Any, error: BaseException) -> None:
    """Fail every batch an aiokafka producer still holds, so it never sends them later.

    aiokafka has no public call for this (see :func:`aiokafka_private.fail_batches`). Without
    it, a producer given up during an outage would keep retrying its batches in the background.
    """
    try:
        aiokafka_private.fail_batches(producer, error)
    except aiokafka_private.AiokafkaPrivateApiError as exc:
        # The bus gives the producer up either way; at worst its batches still go out later.
        aiokafka_private.warn_once(exc)
