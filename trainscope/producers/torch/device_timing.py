"""Device time of the per-step phases: CUDA events on the training stream, resolved elsewhere.

With CUDA's asynchronous execution the host returns from ``forward`` and ``backward`` once
their kernels are queued: host times measure launch, and the GPU time surfaces wherever the host
next waits (an ``.item()``, the optimizer, the next collective), so a slow GPU would be charged
to whichever function synchronises. Each phase is therefore also bracketed by two events
recorded on the current stream (``Event.record()``: queued with the kernels, nothing waited
for); the sender thread resolves them in order once they completed (``Event.query()``, which
never blocks) and files ``start_ns, device_duration_ns`` pairs under the ``gpu_phase`` layer
(and collectives under ``gpu_collective``), beside the host pairs of ``torch_op``. The
store keeps both clocks; the detectors compare device time for the phases that have it.

Nothing here synchronises: the training thread only records events and moves them between two
queues (``deque`` appends and pops, atomic under the GIL, so the sender thread needs no lock).
The events come from a pool of at most ``pool_pairs`` pairs, made as the job first needs them
and reused step after step: when the sender thread falls behind (stalled, or gone) the pool runs
dry and a phase is left without its device time, counted in ``dropped``, rather than allocating
without bound.

Each step's collectives are also summed per step on the device clock, for the step record
(``device_collective_ns``: the early flag's view of who waited, which for NCCL the host's clock
cannot give): a collective's pair carries the step it was issued in, and :meth:`take_step`
says a step's sum once none of its collectives is still in flight on the device.

The event type is a parameter (``torch.cuda.Event`` for CUDA jobs): tests on machines without a
GPU pass a stand-in with the same four methods.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from trainscope.producers.torch.spanlog import PhaseLog
from trainscope.schemas.metrics import DEVICE_COLLECTIVE_LAYER, DEVICE_PHASE_LAYER
from trainscope.schemas.recorder import WindowRecorder

__all__ = ["DEVICE_COLLECTIVE_LAYER", "DEVICE_PHASE_LAYER", "DeviceTimer", "cuda_events"]
# Event pairs in the pool at most: the phases of one sender round (0.5 s) and of the GPU's lag
# behind the host, at 1-ms steps with three phases each and a few collectives (about 2,000),
# twice over; and a bound on what a stalled reader can hold (events are small host objects,
# each a driver event once recorded).
DEFAULT_POOL_PAIRS = 4096


class DeviceEvent(Protocol):
    """What the timer needs of an event: ``torch.cuda.Event(enable_timing=True)``'s methods."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds


EventFactory = Callable[[], DeviceEvent]


def cuda_events() -> EventFactory | None:
    """``torch.cuda.Event`` with timing on, or None where CUDA is not usable here."""
    import torch

    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda.Event(enable_timing=True)


class Pending:
    """A phase whose events were recorded and may not have completed yet; ``step``, for a
    collective, the step it was issued in (-1 for the phases)."""

    __slots__ = ("end", "host_start_ns", "log", "start", "step")

    def __init__(self, log: PhaseLog, host_start_ns: int, start: DeviceEvent,
                 end: DeviceEvent, step: int = -1) -> None:
        self.log = log
        self.host_start_ns = host_start_ns
        self.start = start
        self.end = end
        self.step = step


class DeviceTimer:
    """Brackets phases with pooled events (training thread) and resolves them (sender thread).

    ``begin()`` records a start event and returns it (None when the pool is dry); ``end(...)``
    records the end event and queues the pair. ``resolve()`` files every completed pair, in
    the order they were queued, into its phase's log of device durations.
    """

    def __init__(self, new_event: EventFactory, pool_pairs: int = DEFAULT_POOL_PAIRS) -> None:
        if pool_pairs < 1:
            raise ValueError(f"pool_pairs must be >= 1, got {pool_pairs}")
        # Made as the pool grows to what the job keeps in flight, then reused, never more.
        self._new_event = new_event
        self._free: deque[DeviceEvent] = deque()
        self._made = 0
        self._growing = threading.Lock()
        self._pending: deque[Pending] = deque()
        self._logs: dict[tuple[str, str], PhaseLog] = {}
        self.pool_events = 2 * pool_pairs
        self.dropped = 0
        self.resolved = 0
        # Per step not yet taken: its collectives begun on the device and not yet resolved, and
        # the device time of those resolved. Begun on the training thread or DDP's, resolved
        # on the sender thread: a read-modify-write of a count needs the lock.
        self._steps_lock = threading.Lock()
        self._open_by_step: dict[int, int] = {}
        self._collective_ns_by_step: dict[int, int] = {}
        self._taken_through = -1  # steps up to this one were taken: late pairs are not summed
        # The fixed phases' logs, at hand for the hooks (no look-up per step).
        self.forward = self.log(DEVICE_PHASE_LAYER, "forward")
        self.backward = self.log(DEVICE_PHASE_LAYER, "backward")
        self.optimizer = self.log(DEVICE_PHASE_LAYER, "optimizer.step")

    def log(self, layer: str, name: str) -> PhaseLog:
        """The log of device durations of ``layer``/``name`` (created on first use)."""
        key = (layer, name)
        log = self._logs.get(key)
        if log is None:
            log = self._logs[key] = PhaseLog(layer, name)
        return log

    # -- training thread --------------------------------------------------------------------
    def begin(self, unfinished: DeviceEvent | None = None) -> DeviceEvent | None:
        """A start event recorded on the current stream; None (counted) when the pool is dry.
        ``unfinished``, the start of this phase's previous run if that never reached its end
        (a step that raised, a pass that missed its last hook), goes back to the pool first."""
        if unfinished is not None:
            self._free.append(unfinished)
        try:
            event = self._free.popleft()
        except IndexError:
            event = self._grow()
            if event is None:
                self.dropped += 1
                return None
        event.record()
        return event

    def begin_collective(self, step: int) -> DeviceEvent | None:
        """:meth:`begin` for a collective issued in ``step``, which :meth:`take_step` then
        waits for."""
        event = self.begin()
        if event is not None:
            self._count_open(step, 1)
        return event

    def _count_open(self, step: int, change: int, duration_ns: int = 0) -> None:
        """``change`` the step's collectives in flight; one resolved adds its ``duration_ns``.
        Nothing for a step already taken (its record left without them)."""
        with self._steps_lock:
            if step <= self._taken_through:
                return
            if duration_ns:
                sums = self._collective_ns_by_step
                sums[step] = sums.get(step, 0) + duration_ns
            left = self._open_by_step.get(step, 0) + change
            if left > 0:
                self._open_by_step[step] = left
            else:
                self._open_by_step.pop(step, None)

    def _grow(self, events: int = 2) -> DeviceEvent | None:
        """A new event while the pool is below its bound (two at a time from ``begin``: the
        pair's end). Under a lock: an asynchronous collective's end is recorded on the
        thread that completes it, which may grow the pool while the training thread does."""
        with self._growing:
            if self._made + events > self.pool_events:
                return None
            self._made += events
        for _ in range(events - 1):
            self._free.append(self._new_event())
        return self._new_event()

    def end(self, log: PhaseLog, host_start_ns: int, start: DeviceEvent | None,
            step: int = -1) -> None:
        """Record the end of the phase ``start`` began, to be resolved later (``step``: the
        step a collective begun with :meth:`begin_collective` was issued in)."""
        if start is None:
            return
        try:
            event = self._free.popleft()
        except IndexError:
            # Another phase took the end its begin made (one begun meanwhile, on this thread or
            # another): one more, unless the pool is at its bound (nested phases past it).
            event = self._grow(1)
            if event is None:
                self._free.append(start)
                self.dropped += 1
                if step >= 0:
                    self._count_open(step, -1)
                return
        event.record()
        self._pending.append(Pending(log, host_start_ns, start, event, step))

    def abandon(self, start: DeviceEvent, step: int = -1) -> None:
        """Give back the start event of a phase that will not be timed on the device."""
        self._free.append(start)
        if step >= 0:
            self._count_open(step, -1)

    # -- sender thread ----------------------------------------------------------------------
    def resolve(self) -> int:
        """File the pairs that completed, oldest first, stopping at the first still running
        (a stream runs its work in order); returns how many were filed."""
        pending, free = self._pending, self._free
        filed = 0
        while pending:
            head = pending[0]
            if not head.end.query():
                break
            pending.popleft()
            duration_ns = max(int(head.start.elapsed_time(head.end) * 1e6), 0)
            values = head.log.values
            values.append(head.host_start_ns)
            values.append(duration_ns)
            free.append(head.start)
            free.append(head.end)
            if head.step >= 0:
                self._count_open(head.step, -1, duration_ns)
            filed += 1
        self.resolved += filed
        return filed

    def take_step(self, step: int, force: bool = False) -> int | None:
        """The device time of ``step``'s collectives (0: none timed), once none is in flight
        (sender thread, after :meth:`resolve`); None while one is, unless ``force``, which
        takes what resolved so far. Steps are taken in order: a step's entries, and any left
        by steps before it (their records dropped), go."""
        with self._steps_lock:
            if not force and self._open_by_step.get(step):
                return None
            self._taken_through = max(self._taken_through, step)
            self._open_by_step.pop(step, None)
            taken = self._collective_ns_by_step.pop(step, 0)
            for held in (self._open_by_step, self._collective_ns_by_step):
                if held and min(held) < step:
                    for old in [k for k in held if k < step]:
                        del held[old]
            return taken

    def collective_running_since_ns(self) -> int | None:
        """When the host issued the collective the device is inside now (its start event
        completed, its end not), None when it is in none (sender thread). A stall report's
        waiting on a CUDA job: an NCCL call returns on the host at once, so only the device
        shows a rank stuck in a collective, waiting for a peer that never came."""
        # A copy: the training thread appends meanwhile (list() of a deque runs under the GIL).
        for pair in list(self._pending):
            if pair.step < 0:
                continue  # a phase, not a collective
            if not pair.start.query():
                return None  # the device has not reached it: busy before it
            if not pair.end.query():
                return pair.host_start_ns
        return None

    def steps_in_flight(self) -> int:
        """Steps with a collective still running on the device."""
        return len(self._open_by_step)

    def drain_into(self, recorder: WindowRecorder) -> int:
        """Resolve what completed, then move every phase's pairs to ``recorder``."""
        self.resolve()
        return sum(log.drain_into(recorder) for log in list(self._logs.values()))

    def in_flight(self) -> int:
        return len(self._pending)

    def free_events(self) -> int:
        """Events made and ready for a phase (``made_events()`` when none is lost)."""
        return len(self._free)

    def made_events(self) -> int:
        return self._made
