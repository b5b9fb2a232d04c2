"""A stand-in for a CUDA device's clock and its timing events, for machines without a GPU.

Named a stand-in wherever it is used: it is passed to ``attach(device_events=...)`` (or to a
``DeviceTimer``) as a parameter, in place of ``torch.cuda.Event``. The stand-in device has a
timeline of its own, independent of the host's: work is queued with :meth:`StandInGpu.launch`
(as a kernel launch returns at once on the host), events recorded by the host take the
position of the queue's tail, and they complete only when the device has run that far
(:meth:`StandInGpu.run_queued`), so a reader that does not wait sees them complete later.
Every call on an event is logged with its thread, so a test can tell which thread asked for
what, and any synchronising call (``synchronize``, ``wait``) is logged as such.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class StandInGpu:
    """The stand-in device: a queue position and how far it has run, in device ns."""

    def __init__(self) -> None:
        self.queued_ns = 0  # the tail of the work queued so far
        self.done_ns = 0  # how far the device has run
        self.calls: list[tuple[str, int]] = []  # (method, thread ident)
        self.created = 0
        self._lock = threading.Lock()

    def launch(self, duration_ns: int) -> None:
        """Queue ``duration_ns`` of device work (returns at once, as a kernel launch does)."""
        with self._lock:
            self.queued_ns += duration_ns

    def run_queued(self) -> None:
        """The device runs everything queued so far."""
        with self._lock:
            self.done_ns = self.queued_ns

    def run_to(self, at_ns: int) -> None:
        """The device runs the queued work up to ``at_ns`` of its queue (a kernel that never
        ends: it stops there)."""
        with self._lock:
            self.done_ns = max(self.done_ns, min(at_ns, self.queued_ns))

    def event(self, enable_timing: bool = True) -> StandInEvent:
        assert enable_timing
        self.created += 1
        return StandInEvent(self)

    def log(self, method: str) -> None:
        self.calls.append((method, threading.get_ident()))

    def threads_of(self, method: str) -> set[int]:
        return {ident for name, ident in self.calls if name == method}

    def counts(self) -> Counter[str]:
        return Counter(name for name, _ in self.calls)


class StandInEvent:
    """``torch.cuda.Event(enable_timing=True)``'s methods, on the stand-in device's clock."""

    def __init__(self, gpu: StandInGpu) -> None:
        self.gpu = gpu
        self.at_ns: int | None = None

    def record(self, stream: Any = None) -> None:
        self.gpu.log("record")
        self.at_ns = self.gpu.queued_ns

    def query(self) -> bool:
        self.gpu.log("query")
        return self.at_ns is not None and self.at_ns <= self.gpu.done_ns

    def elapsed_time(self, end: StandInEvent) -> float:
        self.gpu.log("elapsed_time")
        assert self.query() and end.query(), "elapsed_time of an event not completed"
        assert self.at_ns is not None and end.at_ns is not None
        return (end.at_ns - self.at_ns) / 1e6  # milliseconds, as CUDA's

    # What must never be called on the training thread (it would make the host wait).
    def synchronize(self) -> None:
        self.gpu.log("synchronize")
        self.gpu.run_queued()

    def wait(self, stream: Any = None) -> None:
        self.gpu.log("wait")
