"""A time budget for one call of a detector's ``detect()``, enforced in the main thread.

Python cannot stop a thread from outside, and a detector is a plugin's code: it may loop over
a million function names. So the budget is an interval timer (``setitimer(ITIMER_REAL)``) whose
SIGALRM handler raises :class:`OverBudget` in the main thread, where the detector runs. Why
this and not something else:

- a worker thread with a join timeout would return on time but leave the detector running,
  holding the GIL and the detector's state, and the next window would race it;
- a subprocess per call would stop cleanly but cost a fork and a pickle of the window and the
  detector's state on every window of every job;
- the timer costs two system calls per call. Its limit: the exception is raised between
  bytecodes, so a single long numpy/pandas call finishes first (each is bounded by the window's
  size, which the window engine's caps bound).

:class:`OverBudget` derives from ``BaseException``, like ``KeyboardInterrupt``, so a detector's
own ``except Exception`` cannot swallow it. A detector stopped mid-``detect()`` may have changed
part of its state; :class:`~trainscope.detectors.registry.DetectorRunner` therefore replaces
that job's instance with a fresh copy (see there).

Off the main thread (a caller running detectors from a worker thread) no signal can be
delivered there, so the budget is not enforced; ``trainscope pipeline`` runs them in its main
thread.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class OverBudget(BaseException):
    """``detect()`` ran past its time budget and was stopped."""


def can_interrupt() -> bool:
    """Whether a budget can stop a call here (only the main thread receives signals)."""
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


@contextmanager
def time_budget(budget_s: float) -> Iterator[None]:
    """Raise :class:`OverBudget` inside the block once it has run ``budget_s`` seconds.

    Nests under another user of SIGALRM (pytest-timeout's signal method, for one): its handler
    and its remaining time are put back when the block ends, minus the time the block took (an
    outer deadline that falls inside the block fires when the block ends)."""
    if budget_s <= 0 or not can_interrupt():
        yield
        return
    armed = True

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if armed:  # a stray alarm after the block's end must not raise elsewhere
            raise OverBudget(f"over its time budget of {budget_s:g} s")

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_s, previous_interval_s = signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        yield
    finally:
        # Nested: an alarm landing before ``armed`` is cleared raises here (the caller counts
        # the call as over budget), and the handler and timer are put back all the same.
        try:
            armed = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous_handler)
            if previous_s > 0:
                left_s = max(previous_s - (time.monotonic() - started), 1e-3)
                signal.setitimer(signal.ITIMER_REAL, left_s, previous_interval_s)
