"""The training process's wait for a CPU, read from the kernel (``/proc/.../schedstat``).

The contention is real: this process and a busy child process are pinned to the same core, so
the kernel makes them take turns, and the process's run-queue wait is what it lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainscope.producers.torch.schedstat import RunQueueClock
from trainscope.schemas.metrics import PROCESS_RUNQUEUE_WAIT, SCHED_LAYER
from trainscope.schemas.recorder import WindowRecorder

SPIN_S = 0.6


def _spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@contextmanager
def _sharing_a_core_with_a_busy_process() -> Iterator[None]:
    """This process and a busy child pinned to one core, for the duration."""
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {core})
        os.sched_setaffinity(0, {core})
        yield
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()


@dataclass
class _OffCpu:
    ns: int = 0


@contextmanager
def _off_the_cpu() -> Iterator[_OffCpu]:
    """Wall time minus this process's CPU time over the block: for a process that is always
    runnable, the run-queue wait to expect, whoever else (a third process, another test
    worker) shares the core."""
    measured = _OffCpu()
    wall_ns, cpu_ns = time.perf_counter_ns(), time.process_time_ns()
    yield measured
    measured.ns = (time.perf_counter_ns() - wall_ns) - (time.process_time_ns() - cpu_ns)


NO_SCHEDSTAT = pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(),
                                  reason="the kernel keeps no scheduler statistics here "
                                         "(not Linux)")


def _recorded_ns(recorder: WindowRecorder) -> list[int]:
    """The run-queue spans the recorder holds, in ns."""
    return [int(d) for _, functions in recorder.take_all()
            for key, acc in functions.items() if key[:2] == (SCHED_LAYER, PROCESS_RUNQUEUE_WAIT)
            for d in acc.durations_ns]


@NO_SCHEDSTAT
def test_a_process_sharing_its_core_with_a_busy_process_is_charged_the_wait() -> None:
    with _sharing_a_core_with_a_busy_process():
        clock = RunQueueClock()
        assert clock.enabled
        recorder = WindowRecorder.for_window(60.0)
        with _off_the_cpu() as off_cpu:
            _spin(SPIN_S)
            waited_ns = clock.sample_into(recorder, steps_ended=1)
    # Two busy processes on one core: about half the wall time runnable without it, and the
    # wait is the time this always-runnable process spent off the CPU.
    assert waited_ns > 0.2 * SPIN_S * 1e9, waited_ns
    assert waited_ns == pytest.approx(off_cpu.ns, rel=0.25, abs=20e6), (waited_ns, off_cpu.ns)
    assert _recorded_ns(recorder) == [waited_ns]


@NO_SCHEDSTAT
def test_nothing_is_recorded_while_no_step_ends() -> None:
    clock = RunQueueClock()
    recorder = WindowRecorder.for_window(60.0)
    assert clock.sample_into(recorder, steps_ended=0) == 0  # idle: no step since attach
    _spin(0.05)
    clock.sample_into(recorder, steps_ended=3)
    clock.sample_into(recorder, steps_ended=3)  # no step since the last read
    assert len(_recorded_ns(recorder)) == 1


@NO_SCHEDSTAT
def test_a_thread_started_after_attach_brings_its_wait_and_its_end_takes_none() -> None:
    """A thread started after attach brings its wait; a thread gone takes its count away
    without making the process's wait go backwards."""
    with _sharing_a_core_with_a_busy_process():
        clock = RunQueueClock()
        recorder = WindowRecorder.for_window(60.0)
        spun, may_end = threading.Event(), threading.Event()

        def spin_then_wait_to_end() -> None:
            _spin(SPIN_S / 2)
            spun.set()
            may_end.wait()  # alive, off the CPU, until its wait has been read

        worker = threading.Thread(target=spin_then_wait_to_end)
        with _off_the_cpu() as with_worker_off:
            worker.start()
            spun.wait()  # the main thread blocked, off the CPU: only the worker is runnable
            with_worker_ns = clock.sample_into(recorder, steps_ended=1)
        may_end.set()
        worker.join()
        with _off_the_cpu() as alone_off:
            _spin(SPIN_S / 2)  # the worker is gone
            alone_ns = clock.sample_into(recorder, steps_ended=2)
    # Against the busy process, this process ran about half the time in each half, one thread
    # runnable at a time: the first half's wait is the worker's alone (the main thread, blocked
    # on an event, waited on a lock, not in the run queue), so it is counted although the
    # worker started after the clock did, and the worker's end takes nothing from the second
    # half. (A thread that starts and ends between two reads takes its wait with it: the
    # kernel keeps no count of a thread that is gone. Training threads live as long as the job.)
    # (Two threads taking turns for the GIL would both be runnable at times, each wait counted:
    # the sum over threads is thread time spent waiting, which can exceed the wall time.)
    half_s = SPIN_S / 2
    for waited_ns, off in ((with_worker_ns, with_worker_off), (alone_ns, alone_off)):
        assert 0.25 * half_s * 1e9 < waited_ns, (with_worker_ns, alone_ns)
        assert waited_ns == pytest.approx(off.ns, rel=0.25, abs=20e6), (waited_ns, off.ns)
    assert _recorded_ns(recorder) == [with_worker_ns, alone_ns]


def test_an_unreadable_statistics_file_turns_the_clock_off(tmp_path: Path) -> None:
    clock = RunQueueClock(tasks=str(tmp_path / "missing"))
    recorder = WindowRecorder.for_window(60.0)
    assert not clock.enabled
    assert clock.sample_into(recorder, steps_ended=5) == 0 and _recorded_ns(recorder) == []


def test_statistics_that_read_zero_are_taken_as_not_kept(tmp_path: Path) -> None:
    """A kernel without scheduler statistics shows ``0 0 0``: no wait of 0 ns is invented."""
    (tmp_path / "101").mkdir()
    (tmp_path / "101" / "schedstat").write_text("0 0 0\n")
    clock = RunQueueClock(tasks=str(tmp_path))
    recorder = WindowRecorder.for_window(60.0)
    assert clock.sample_into(recorder, steps_ended=5) == 0
    assert not clock.enabled and _recorded_ns(recorder) == []
