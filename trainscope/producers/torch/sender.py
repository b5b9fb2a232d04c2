"""The background sender of ``attach()``: this rank's outbox and the work of its thread.

The training thread only calls :meth:`Sender.submit` (an append under a lock, or drop and count
when full). Everything else happens on the sender's daemon thread: condensing the recorder's
closed windows into summaries, encoding batches and publishing them. Heavy tasks handed over
by the training thread (a profile's condensation, seconds of Python on a busy rank) run on a
second daemon thread of their own, so that they never hold back the windows: behind one, a
rank's step records and summaries reached the stream job after their windows had closed.
Queueing, the drop policy, retries during an outage and the counts are those of the transport
layer's :class:`~trainscope.transport.outbox.Outbox`, the same for every producer: ``acked``
means acknowledged by the broker, and ``submitted`` = ``acked`` + ``dropped`` + ``failed`` +
``queued``.
"""

from __future__ import annotations

import threading
import time
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
    windows, and a second thread that runs the tasks the training thread hands over.

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
        self._tasks_cond = threading.Condition()
        self._tasks_thread: threading.Thread | None = None
        self._task_running = False

    # -- training thread (and submit, from Outbox) ---------------------------------------------
    def submit_encoded(self, topic: str, payload: bytes, records: int) -> bool:
        """An already-encoded message for another topic (e.g. the op trace); same bound."""
        return self.offer_encoded(topic, self._key, payload, records)

    def submit_task(self, task: Callable[[], list[Any]]) -> None:
        """Run ``task`` on the task thread; the records it returns are sent (heavy work goes
        here, never on the training thread)."""
        with self._tasks_cond:
            self._tasks.append(task)
            if self._tasks_thread is None:
                self._tasks_thread = threading.Thread(
                    target=self._run_tasks, name="trainscope-tasks", daemon=True)
                self._tasks_thread.start()
            self._tasks_cond.notify()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Finish the tasks handed over and send what can be sent, within about ``timeout_s``,
        then close the bus; never raises."""
        deadline = time.monotonic() + timeout_s
        with self._tasks_cond:
            while (self._tasks or self._task_running) and time.monotonic() < deadline:
                self._tasks_cond.wait(max(0.0, deadline - time.monotonic()))
            self._tasks.clear()  # not begun in time: dropped with the thread
        self.close(max(0.1, deadline - time.monotonic()))

    def reset_after_fork(self) -> None:
        super().reset_after_fork()
        self._tasks.clear()
        self._tasks_cond = threading.Condition()  # held, maybe, by a thread the child lacks
        self._tasks_thread = None
        self._task_running = False

    # -- task thread --------------------------------------------------------------------------
    def _run_tasks(self) -> None:
        while True:
            with self._tasks_cond:
                while not self._tasks:
                    self._tasks_cond.wait()
                task = self._tasks.popleft()
                self._task_running = True
            try:
                records = task()
                if records:
                    self.offer_many(records, self._key)
            except Exception as exc:
                self._guard.report("sender task", exc)
            finally:
                with self._tasks_cond:
                    self._task_running = False
                    self._tasks_cond.notify_all()

    # -- sender thread ------------------------------------------------------------------------
    def _gather(self, final: bool) -> None:
        records: list[Any] = []
        for producer in self._producers:
            try:
                records.extend(producer(final))
            except Exception as exc:
                self._guard.report("window summaries", exc)
        if records:
            self.offer_many(records, self._key)
