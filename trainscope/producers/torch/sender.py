"""The background sender of ``attach()``: this rank's outbox and the work of its thread.

The training thread only calls :meth:`Sender.submit` (an append under a lock, or drop and count
when full). Everything else happens on the sender's daemon thread: condensing the recorder's
closed windows into summaries, running heavy tasks handed over by the training thread (a
profile's condensation), encoding batches and publishing them. Queueing, the drop policy,
retries during an outage and the counts are those of the transport layer's
:class:`~trainscope.transport.outbox.Outbox`, the same for every producer: ``acked`` means
acknowledged by the broker, and ``submitted`` = ``acked`` + ``dropped`` + ``failed`` +
``queued``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from trainscope.producers.torch.safety import Guard
from trainscope.transport.outbox import DEFAULT_BATCH_RECORDS, BusFactory, Outbox

__all__ = ["MAX_BATCH_RECORDS", "BusFactory", "Sender"]

MAX_BATCH_RECORDS = DEFAULT_BATCH_RECORDS


class Sender(Outbox):
    """The PyTorch producer's sender: the rank's :class:`Outbox` (records keyed ``job/rank``,
    so a rank's messages stay in order on one partition), whose thread also condenses closed
    windows and runs the tasks the training thread hands over.

    It owns that thread, the bounded queue of what waits for the broker, the counts of what
    became of every record, and the bus when it opened it (``owns_bus``). ``producers`` are
    called on its thread every round (argument: final round) for more records, e.g. the
    summaries of windows that just closed.
    """

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
        super().__init__(
            bus_factory,
            owns_bus=owns_bus,
            capacity=capacity,
            batch_records=MAX_BATCH_RECORDS,
            flush_interval_s=flush_interval_s,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            key=key,
            name="trainscope-sender",
            report=guard.report,
        )
        self._key = key
        self._guard = guard
        self._producers = producers or []
        self._tasks: deque[Callable[[], list[Any]]] = deque()

    # -- training thread (and submit, from Outbox) ---------------------------------------------
    def submit_encoded(self, topic: str, payload: bytes, records: int) -> bool:
        """An already-encoded message for another topic (e.g. the op trace); same bound."""
        return self.offer_encoded(topic, self._key, payload, records)

    def submit_task(self, task: Callable[[], list[Any]]) -> None:
        """Run ``task`` on the sender thread; it returns records to send (heavy work goes here)."""
        with self._cond:
            self._tasks.append(task)
            self._cond.notify()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Send what can be sent within ``timeout_s``, then close the bus; never raises."""
        self.close(timeout_s)

    def reset_after_fork(self) -> None:
        super().reset_after_fork()
        self._tasks.clear()

    # -- sender thread ------------------------------------------------------------------------
    def _gather(self, final: bool) -> None:
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
        if records:
            self.offer_many(records, self._key)
