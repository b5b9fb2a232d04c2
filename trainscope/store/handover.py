"""An embedded store passed between the processes that use it, as they come and go.

chDB lets one process own a store directory. Two kinds of owner take turns on a single machine:
a writer (``trainscope pipeline``, ``trainscope whatif``) and a reader that happened to open it
first (``trainscope ui`` on a store no pipeline ran on yet). Without a hand-over, the dashboard
opened on the demo's store kept the pipeline from starting on it, and a dashboard that read a
live store through the pipeline's endpoint answered every request with an error once that
pipeline stopped or restarted.

- A reader that owns the store says so in its read endpoint's file (``yields``); a writer that
  finds the store held by such a reader asks it to hand the store over
  (:func:`trainscope.store.access.ask_owner_to_yield`: a signal, then a wait for the engine's
  lock to go) instead of refusing to start.
- :class:`FollowedStore` is the reader's side: read-only access to a store whoever owns it,
  reading through the owner's endpoint, or owning the store (and serving reads) when nobody
  else does; it follows a change of owner between two queries, and hands the store over when
  asked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from trainscope.store.access import YIELD_SIGNAL, other_owner, status_pid
from trainscope.store.client import StoreError, connect, embedded_path
from trainscope.store.live import Endpoint, ReadEndpoint, read_endpoint, serve_reads

log = logging.getLogger(__name__)

HANDOVER_S = 30.0  # how long a reader that handed the store over leaves it to the writer
FOLLOW_WAIT_S = 3.0  # how long a query waits for a store whose owner just left to settle

T = TypeVar("T")


class FollowedStore:
    """Read-only access to the embedded store at ``path``, whichever process owns it.

    :meth:`run` gives a query a clickhouse-connect client: of the owner's read endpoint while
    another process owns the store, else of the store itself, opened read-only (this process
    then owns it and serves reads to others, saying it yields). When the owner it read through
    has gone (a pipeline stopped or restarted), the query is retried once on whatever serves
    the store then. :meth:`hand_over` (on :data:`YIELD_SIGNAL`, see :meth:`yield_on_signal`)
    releases a store this process owns, and leaves it to the writer that asked until the writer
    has opened it (at most ``handover_s``); meanwhile a query raises ``StoreError`` saying so.

    One query at a time (chDB is not safe from several threads at once).
    """

    def __init__(self, path: Path, *, handover_s: float = HANDOVER_S,
                 follow_wait_s: float = FOLLOW_WAIT_S) -> None:
        self.path = path
        self.handover_s = handover_s
        self.follow_wait_s = follow_wait_s
        self._client: Any = None
        self._owns = False  # whether _client opened the store itself
        self._endpoint: Endpoint | None = None  # the other owner's we read through
        self._reads: ReadEndpoint | None = None  # ours, while we own the store
        self._handed_over_at: float | None = None
        self._lock = threading.RLock()

    @property
    def owned(self) -> bool:
        """Whether this process owns the store now."""
        return self._client is not None and self._owns

    def open(self) -> None:
        """Resolve the store now (``StoreError`` if it cannot be read at all)."""
        with self._lock:
            self._current()

    def run(self, query: Callable[[Any], T]) -> T:
        """``query(client)``; retried once on the store's new owner if the one it read
        through has gone."""
        with self._lock:
            client = self._settled()
            try:
                return query(client)
            except Exception:
                if self._endpoint is None or read_endpoint(self.path) == self._endpoint:
                    raise  # the owner we read through still serves: the query's own error
            log.info("store %s: its owner (process %d) has gone; following the store",
                     self.path, self._endpoint.pid)
            self._drop()
            return query(self._settled())

    def hand_over(self) -> None:
        """Release the store if this process owns it (a writer asked for it)."""
        with self._lock:
            if not self.owned:
                return
            self._drop()
            self._handed_over_at = time.monotonic()
            log.info("store %s: handed over to a writer that asked for it", self.path)

    def yield_on_signal(self) -> None:
        """Hand the store over when a writer sends :data:`YIELD_SIGNAL` (main thread only).
        The release runs in a thread of its own: it waits for a running query to end."""
        def on_signal(signum: int, frame: Any) -> None:
            threading.Thread(target=self.hand_over, name="trainscope-store-handover",
                             daemon=True).start()

        signal.signal(YIELD_SIGNAL, on_signal)

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _current(self) -> Any:
        if self._client is None:
            self._resolve()
        return self._client

    def _settled(self) -> Any:
        """The client of the store's next owner, waiting a little for one that is leaving
        (its engine's lock outlives its endpoint by a moment) or arriving."""
        deadline = time.monotonic() + self.follow_wait_s
        while True:
            try:
                return self._current()
            except StoreError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _resolve(self) -> None:
        recent = (self._handed_over_at is not None
                  and time.monotonic() - self._handed_over_at < self.handover_s)
        # Not taken back before the writer that asked has opened it (the engine's status file
        # then holds its pid, no longer ours), for at most handover_s if it never does.
        if recent and other_owner(self.path) is None and status_pid(self.path) == os.getpid():
            raise self._handing_over()
        try:
            client = connect(self.path, readonly=True, create=False)
        except StoreError:
            if recent:  # the writer holds the store and serves no reads (yet, or at all)
                raise self._handing_over() from None
            raise
        self._handed_over_at = None
        self._owns = embedded_path(client) is not None
        if self._owns:
            self._endpoint = None
            self._reads = serve_reads(self.path, yields=True)
        else:
            self._endpoint = read_endpoint(self.path)
        self._client = client

    def _handing_over(self) -> StoreError:
        return StoreError(f"store {self.path} is being handed to a process that writes it; "
                          "retry in a few seconds")

    def _drop(self) -> None:
        if self._reads is not None:
            self._reads.stop()
            self._reads = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        self._owns = False
        self._endpoint = None
