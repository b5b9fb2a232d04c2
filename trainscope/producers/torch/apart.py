"""Heavy Python work of ours run in a forked child, away from the training process's GIL.

Condensing a profiler session walks every event it recorded as a Python object: in a
Python-heavy loop (preprocessing in the loop body, 100,000 C calls a step) that is hundreds of
thousands of events and seconds of Python. On a thread of the training process it holds the
GIL the whole time, and every torch op of the training thread, which releases the GIL and must
take it back, then waits up to the interpreter's switch interval: a real 4-rank job ran 4-5x
slower for 6 s after each profile, and its peers waited for it. A forked child has its own
interpreter and a copy-on-write view of the result, so the training process only waits on a
pipe (without the GIL).

Forking a process with threads is what PyTorch's DataLoader does by default on Linux; the child
here touches only the profiler's result, numpy and our own code (no CUDA, no locks of other
threads), writes its answer to a pipe and leaves with ``os._exit`` (no atexit handlers, no
flush of the parent's buffers). Where ``fork`` is missing, or the child fails or outlives its
deadline, the caller is told with :class:`ApartError` and decides (the profile is dropped and
counted, never retried in the training process).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import time
import warnings
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# The child yields a shared core to the training processes (a quarter of it against one busy
# process): the training job comes first, and a host without spare cores pays for our
# condensing partly with a later answer. Not lower: at nice +10 a 4-rank job on 2 busy cores
# ended before its profile was condensed, and at +19 or SCHED_IDLE a core that a CPU-bound
# rank keeps busy gave the child next to nothing for minutes.
CHILD_NICENESS = 5
_READ_BYTES = 1 << 20


class ApartError(RuntimeError):
    """The work could not be done in a child: no fork here, the child failed, or it timed out."""


def can_fork() -> bool:
    return hasattr(os, "fork")


def run_apart(work: Callable[[], T], timeout_s: float) -> T:
    """``work()``'s result, computed in a forked child and handed back pickled.

    Raises :class:`ApartError` when the child cannot be made, exits without an answer, or has
    not answered within ``timeout_s`` (it is then killed).
    """
    if not can_fork():
        raise ApartError("this platform cannot fork")
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns on every fork of a process with threads; this child is made to
        # be forked from one (see the module's docstring).
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: never returns
        _child(work, read_fd, write_fd)
    os.close(write_fd)
    try:
        data = _read_all(read_fd, pid, time.monotonic() + timeout_s)
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0 or not data:
        raise ApartError(f"the child process ended without an answer (wait status {status})")
    return pickle.loads(data)


def _child(work: Callable[[], object], read_fd: int, write_fd: int) -> None:
    code = 1
    try:
        os.close(read_fd)
        with contextlib.suppress(OSError):
            os.nice(CHILD_NICENESS)
        # A rank pinned to its cores (NUMA-local, or beside a noisy neighbour) would otherwise
        # lend them to the child; anywhere, the kernel puts it on a core with room.
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        data = pickle.dumps(work(), protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
        code = 0
    except BaseException:  # the parent reads the exit code: nothing may escape the child
        code = 1
    finally:
        os._exit(code)


def _read_all(read_fd: int, pid: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([read_fd], [], [], max(0.0, remaining))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise ApartError("the child process did not answer in time; it was killed")
        chunk = os.read(read_fd, _READ_BYTES)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
