"""Telling a training job about a bus outage: once when it starts, once when it ends.

A broker that is down for a minute makes every send fail many times over; the training job's
log should get a line when the bus goes away, a line when the queue starts dropping, and a line
when the bus is back, with how much was dropped meanwhile. Thread-safe: failures are reported
from the bus's thread as well as the sender's.
"""

from __future__ import annotations

import logging
import threading
import time

from trainscope.producers.torch.safety import log


class OutageLog:
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
            "trainscope: the bus is unreachable (%s: %s); training continues, records wait in a "
            "bounded queue (%d) and are dropped (counted) when it is full; retrying in the "
            "background (logged once until it is back)",
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
