"""The owner of an embedded store serves reads: a read-only endpoint on ClickHouse's HTTP interface.

chDB allows one owning process per store directory, so while ``trainscope pipeline`` writes a
store no other process can open it. The owner therefore answers other processes' queries
itself: clickhouse-connect, ``trainscope sql/ui/plan --store DIR`` (through
:func:`trainscope.store.client.connect`) and Grafana's ClickHouse data source speak to it as to
a ClickHouse server. Its address is written into the store directory (:data:`ENDPOINT_FILE`),
so a reader needs only the directory.

It never holds up the stream job: it runs in its own threads on its own engine handles (no lock
is shared with the writer, measured: an insert beside a running read took ~20 ms), and every
query runs with a time limit, result size limits, a memory limit and ClickHouse's
``readonly=1``, after :mod:`trainscope.store.readonly_sql` has refused anything but one read.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import json
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from trainscope.config import env
from trainscope.store.live_http import Handler, Reply
from trainscope.store.readonly_sql import Refused

log = logging.getLogger(__name__)

ENDPOINT_FILE = "trainscope-endpoint.json"
"""The endpoint's address, in the store directory while its owner serves reads."""

DEFAULT_BIND = "127.0.0.1"


@dataclass(frozen=True)
class Limits:
    """What one query may take: its time, result, memory and threads (ClickHouse settings of
    the serving handles), and how many readers are served at once."""

    max_execution_time_s: int = 30
    max_result_rows: int = 1_000_000
    max_result_bytes: int = 256 * 2**20
    max_memory_usage: int = 2 * 2**30
    max_threads: int = 2
    handles: int = 2
    connections: int = 16
    max_body_bytes: int = 2**20

    def session(self) -> list[str]:
        """The ``SET`` statements of a serving handle; ``readonly`` last, as it freezes the
        others."""
        return [
            f"SET max_execution_time = {self.max_execution_time_s}",
            "SET timeout_overflow_mode = 'throw'",
            f"SET max_result_rows = {self.max_result_rows}",
            f"SET max_result_bytes = {self.max_result_bytes}",
            "SET result_overflow_mode = 'throw'",
            f"SET max_memory_usage = {self.max_memory_usage}",
            f"SET max_threads = {self.max_threads}",
            "SET readonly = 1",
        ]


@dataclass(frozen=True)
class Endpoint:
    """Where an owner serves reads, as written in :data:`ENDPOINT_FILE`."""

    host: str
    port: int
    pid: int
    token_required: bool
    # The owner only reads (``trainscope ui``): it hands the store over to a process that
    # must write it (trainscope.store.handover).
    yields: bool = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def read_endpoint(store: Path) -> Endpoint | None:
    """The endpoint the store's owner serves, or ``None``: no file, an unreadable one, or one
    left by a process that is gone (a crash or kill skips the removal)."""
    try:
        data = json.loads((store / ENDPOINT_FILE).read_text())
        found = Endpoint(host=str(data["host"]), port=int(data["port"]), pid=int(data["pid"]),
                         token_required=bool(data["token_required"]),
                         yields=bool(data.get("yields", False)))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if pid_alive(found.pid) else None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


class _Engine:
    """The serving side of the engine: a few chDB handles of the owner's store, each set up
    with the limits and ``readonly=1``, lent to one query at a time."""

    def __init__(self, store: Path, limits: Limits) -> None:
        import chdb

        self.limits = limits
        self._pool: queue.Queue[Any] = queue.Queue()
        self._databases: dict[int, str] = {}
        for _ in range(limits.handles):
            conn = chdb.connect(os.path.realpath(store))
            for statement in limits.session():
                conn.query(statement)
            self._pool.put(conn)
        self.timezone = self.run("SELECT timezone()", "TabSeparated", {}, None)[0].decode().strip()

    def run(self, sql: str, fmt: str, params: dict[str, str],
            database: str | None) -> tuple[bytes, dict[str, str]]:
        """The query's output and a ClickHouse-style summary; raises the engine's error."""
        try:
            conn = self._pool.get(timeout=self.limits.max_execution_time_s)
        except queue.Empty:
            raise Refused("too many queries at once: retry later") from None
        try:
            if database and self._databases.get(id(conn), "default") != database:
                conn.query(f"USE `{database}`")
                self._databases[id(conn)] = database
            result = conn.query(sql, fmt, params=params)
            return result.bytes() or b"", _summary(result)
        finally:
            self._pool.put(conn)

    def close(self) -> None:
        # A handle lent to a running query comes back when it ends; the owner's exit waits a
        # little for it, not the whole query time limit.
        for _ in range(self.limits.handles):
            try:
                conn = self._pool.get(timeout=2.0)
            except queue.Empty:
                return
            with contextlib.suppress(Exception):
                conn.close()


def _summary(result: Any) -> dict[str, str]:
    try:
        return {"read_rows": str(result.rows_read()), "read_bytes": str(result.bytes_read()),
                "elapsed_ns": str(int(result.elapsed() * 1e9))}
    except Exception:  # an engine build without statistics: the summary is optional
        return {}


class _Server(ThreadingHTTPServer):
    """One thread per connection, at most ``limits.connections`` of them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], live: ReadEndpoint) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.live = live
        self._slots = threading.BoundedSemaphore(live.limits.connections)
        super().__init__(address, Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # a flood of connections is turned away, not queued
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class ReadEndpoint:
    """The read-only ClickHouse HTTP endpoint of a store this process owns.

    ``start()`` opens its engine handles, listens on ``host`` (a free port unless ``port`` is
    given) in a daemon thread and writes :data:`ENDPOINT_FILE`; ``stop()`` (also at interpreter
    exit) removes the file and stops serving. With a ``token`` every request must carry it as
    ClickHouse's password (basic auth, ``X-ClickHouse-Key`` or ``password=``) or a bearer token.
    ``yields``: the owner only reads the store and hands it over to a writer that asks.
    """

    def __init__(self, store: Path, *, host: str = DEFAULT_BIND, port: int = 0,
                 token: str | None = None, limits: Limits | None = None,
                 yields: bool = False) -> None:
        self.store = Path(store)
        self.yields = yields
        self.host = host
        self.port = port
        self.token = token or None
        self.limits = limits or Limits()
        self.endpoint: Endpoint | None = None
        self.queries = 0
        self.refused = 0
        self._engine: _Engine | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Endpoint:
        self._engine = _Engine(self.store, self.limits)
        self._server = _Server((self.host, self.port), self)
        host, port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="trainscope-read-endpoint", daemon=True)
        self._thread.start()
        self.endpoint = Endpoint(host=str(host), port=int(port), pid=os.getpid(),
                                 token_required=self.token is not None, yields=self.yields)
        self._write_file(self.endpoint)
        atexit.register(self.stop)
        return self.endpoint

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._remove_file()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __enter__(self) -> ReadEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def authorized(self, offered: list[str]) -> bool:
        if self.token is None:
            return True
        want = self.token.encode()
        return any(hmac.compare_digest(want, o.encode()) for o in offered)

    def answer(self, sql: str, fmt: str, params: dict[str, str],
               database: str | None) -> Reply:
        """Runs a checked query; the reply carries ClickHouse's response headers."""
        if self._engine is None:
            raise Refused("the store's owner is shutting down")
        started = time.perf_counter()
        body, summary = self._engine.run(sql, fmt, params, database)
        self.queries += 1
        log.debug("read endpoint: %.1f ms, %d bytes", (time.perf_counter() - started) * 1e3,
                  len(body))
        return Reply(200, body, {
            "X-ClickHouse-Format": _trailing_format(sql) or fmt,
            "X-ClickHouse-Timezone": self._engine.timezone,
            "X-ClickHouse-Summary": json.dumps(summary),
            "X-ClickHouse-Query-Id": str(uuid.uuid4()),
        })

    def _write_file(self, endpoint: Endpoint) -> None:
        final = self.store / ENDPOINT_FILE
        staged = final.with_name(f".{ENDPOINT_FILE}.{os.getpid()}")
        staged.write_text(json.dumps({**asdict(endpoint), "url": endpoint.url}) + "\n")
        os.replace(staged, final)  # a reader never sees half a file

    def _remove_file(self) -> None:
        # Only our own: after a restart a newer owner's file may be there.
        path = self.store / ENDPOINT_FILE
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError, AttributeError):
            pass


_FORMAT = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.IGNORECASE)


def _trailing_format(sql: str) -> str | None:
    m = _FORMAT.search(sql)
    return m.group(1) if m else None


def serve_reads(store: Path | str, *, environ: dict[str, str] | None = None,
                limits: Limits | None = None, yields: bool = False) -> ReadEndpoint | None:
    """Starts the read endpoint of a store this process owns, configured from the environment
    (:data:`~trainscope.config.env.TRAINSCOPE_STORE_READ_BIND`, ``…_TOKEN``); ``None`` if
    switched off or if it cannot start, which is logged but never stops the owner. ``yields``:
    see :class:`ReadEndpoint`."""
    e = os.environ if environ is None else environ
    host = e.get(env.TRAINSCOPE_STORE_READ_BIND, "").strip() or DEFAULT_BIND
    if host.lower() == "off":
        return None
    live = ReadEndpoint(Path(store), host=host, token=e.get(env.TRAINSCOPE_STORE_READ_TOKEN),
                        limits=limits, yields=yields)
    try:
        live.start()
    except Exception as exc:  # reads are a convenience; the owner's writes go on regardless
        log.warning("store %s: the read endpoint did not start (%s); other processes cannot "
                    "query this store while it runs", store, exc)
        live.stop()
        return None
    return live
