"""Listens on the control topic for requests addressed to this process (job, rank).

A daemon thread with its own consumer; a consumer error (the bus went away) closes it and
retries with backoff. Requests issued before this process attached are ignored, so a restarted
job does not replay old profiling requests.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from trainscope.producers.torch.safety import Guard
from trainscope.schemas.codec import BadMessage, decode_batch
from trainscope.schemas.records import ControlMessage
from trainscope.transport.bus import CONTROL_TOPIC, Bus

POLL_TIMEOUT_S = 0.5


class ControlListener:
    def __init__(
        self,
        *,
        bus_factory: Callable[[], Bus],
        owns_bus: bool,
        job_id: str,
        rank: int,
        on_request: Callable[[ControlMessage], None],
        guard: Guard,
        not_before_ns: int,
        backoff_max_s: float = 10.0,
    ) -> None:
        self._bus_factory = bus_factory
        self._owns_bus = owns_bus
        self.job_id = job_id
        self.rank = rank
        self._on_request = on_request
        self._guard = guard
        self._not_before_ns = not_before_ns
        self._backoff_max_s = backoff_max_s
        self._group = f"trainscope-control-{job_id}-{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: set[str] = set()
        self.counts = {"received": 0, "accepted": 0, "ignored": 0, "rejected": 0, "errors": 0}

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="trainscope-control", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 0.0) -> None:
        """Ask the thread to end. It ends at its next poll (at most ``POLL_TIMEOUT_S``) and
        closes its consumer itself; by default nobody waits for that, since ``detach()`` runs
        on the training thread, which must not sit out a poll (a daemon thread: it never
        holds up the interpreter's exit). ``timeout_s`` waits that long for it."""
        self._stop.set()
        if self._thread is not None and timeout_s > 0:
            self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        backoff_s = 0.5
        bus: Bus | None = None
        consumer: Any = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    bus = self._bus_factory()
                    consumer = bus.consumer([CONTROL_TOPIC], self._group)
                messages = consumer.poll(timeout_s=POLL_TIMEOUT_S)
                for message in messages:
                    self._handle(message.value)
                if messages:
                    consumer.commit()
                backoff_s = 0.5
            except Exception as exc:
                self.counts["errors"] += 1
                self._guard.report("control listener", exc)
                self._close(consumer, bus)
                consumer, bus = None, None
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self._backoff_max_s)
        self._close(consumer, bus)

    def _close(self, consumer: Any, bus: Bus | None) -> None:
        for closable in (consumer, bus if self._owns_bus else None):
            if closable is None:
                continue
            try:
                closable.close()
            except Exception as exc:
                self._guard.report("control listener close", exc)

    def _handle(self, payload: bytes) -> None:
        try:
            records = decode_batch(payload)
        except BadMessage as exc:
            self.counts["rejected"] += 1
            self._guard.report("control message", exc)
            return
        for record in records:
            if not isinstance(record, ControlMessage):
                continue
            self.counts["received"] += 1
            if (
                record.job_id != self.job_id
                or record.rank not in (self.rank, -1)
                or (record.issued_ns and record.issued_ns < self._not_before_ns)
                or (record.request_id and record.request_id in self._seen)
            ):
                self.counts["ignored"] += 1
                continue
            if record.request_id:
                self._seen.add(record.request_id)
            self.counts["accepted"] += 1
            self._on_request(record)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes (for tests and the CLI)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
