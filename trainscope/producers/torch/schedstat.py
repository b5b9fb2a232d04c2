"""How long the training process waited for a CPU, read from the kernel's scheduler statistics.

A rank whose threads are runnable but have no core (a busy neighbour pinned to its core, more
ranks than cores, a noisy host) is late for reasons none of our hooks can see: the time lands in
whatever function was running when a thread was preempted. The kernel counts it per thread:
``/proc/<pid>/task/<tid>/schedstat`` holds the thread's time on a CPU, its time *waiting on a
run queue* and its number of time slices. The training thread's own count is not enough: it
also waits, off the CPU, for the GIL or for a gloo thread that itself waits for a core. So the
sender thread sums the run-queue time of every thread of the process, once per round (every
``flush_interval_s``), and records what passed since the last read as a span of
``sched/process_runqueue_wait``: nothing runs on the training thread, and a read of a few
threads costs a few tens of microseconds.

The eBPF agent, where it runs, reports the same process-wide wait as ``sched/runqueue_wait``;
the two names differ so that neither is added to the other (detectors read the larger).
Where the files are missing (not Linux) or read zero (scheduler statistics not kept), nothing
is recorded.
"""

from __future__ import annotations

import os
import time

from trainscope.schemas.metrics import PROCESS_RUNQUEUE_WAIT, SCHED_LAYER
from trainscope.schemas.recorder import WindowRecorder


def _read(path: str) -> tuple[int, int] | None:
    """(time on a CPU, time waiting on a run queue) in ns, or None if unreadable."""
    try:
        with open(path, "rb") as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def _threads(tasks: str) -> dict[str, tuple[int, int]] | None:
    """Each thread's reading, by thread id; None if the process's threads cannot be listed."""
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    readings = {}
    for tid in tids:
        reading = _read(f"{tasks}/{tid}/schedstat")
        if reading is not None:  # a thread that ended in between
            readings[tid] = reading
    return readings


class RunQueueClock:
    """The run-queue wait of every thread of this process, recorded as spans per read."""

    __slots__ = ("_last_ns", "_last_step", "_waits", "tasks")

    def __init__(self, tasks: str | None = None) -> None:
        self.tasks: str | None = tasks or f"/proc/{os.getpid()}/task"
        self._last_ns = 0
        self._last_step = 0
        self._waits: dict[str, int] = {}
        self.restart()

    def restart(self) -> None:
        """Take the current readings as the origin (at attach time)."""
        readings = _threads(self.tasks) if self.tasks else None
        if not readings:
            self.tasks = None
            return
        self._last_ns = time.time_ns()
        self._waits = {tid: wait for tid, (_, wait) in readings.items()}

    @property
    def enabled(self) -> bool:
        return self.tasks is not None

    def sample_into(self, recorder: WindowRecorder, steps_ended: int) -> int:
        """Record the run-queue wait since the last read (sender thread); returns it in ns.

        Only while the job trains (``steps_ended`` moved since the last read): an idle or
        finished job sends nothing, as with every other function.
        """
        if self.tasks is None:
            return 0
        readings = _threads(self.tasks)
        now_ns = time.time_ns()
        if not readings:  # a forked child reading its parent's threads, or /proc gone
            self.tasks = None
            return 0
        if not any(on_cpu for on_cpu, _ in readings.values()):
            self.tasks = None  # threads that ran have CPU time: the statistics are not kept
            return 0
        # A thread started since the last read brings all of its wait; one that ended takes
        # its wait since the last read with it (one round's at most; a thread that starts and
        # ends between two reads is not seen: the kernel keeps no count of a thread gone).
        waited_ns = sum(max(wait - self._waits.get(tid, 0), 0)
                        for tid, (_, wait) in readings.items())
        self._waits = {tid: wait for tid, (_, wait) in readings.items()}
        trained = steps_ended != self._last_step
        self._last_step = steps_ended
        start_ns, self._last_ns = self._last_ns, now_ns
        if not trained:
            return 0
        # A span from the last read to now: it belongs to the window the interval started in,
        # a half-second round at most away from the window it fell in.
        recorder.add(SCHED_LAYER, PROCESS_RUNQUEUE_WAIT, start_ns, waited_ns)
        return waited_ns

    def disable(self) -> None:
        self.tasks = None
