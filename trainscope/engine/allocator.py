"""The stream job's process keeps the memory it frees for its next window.

Closing a window allocates and frees the same large numpy arrays every time: at 10,000 ranks
tens of MB each, at 100,000 ranks several hundred (the sketch entries of a window, gathered in
key order). glibc maps every block above 32 MiB afresh and unmaps it when freed, and gives free
memory at the top of its heap back to the kernel, so each window faults the same amount of
memory in again and the kernel zeroes it again. On a virtual machine that reports free pages to
its host (``virtio-balloon``'s free page reporting, common in clouds), memory handed back is
also taken away from the guest, and touching it again costs the host's faults as well: on the
machine the benchmarks ran on, 0.45–0.67 s of CPU to fault in 272 MB that had been handed back,
0.045 s when it had not. Two of glibc's ``mallopt`` settings keep the memory in the process
instead: no block is mapped on its own (``M_MMAP_MAX`` 0: all come from the heap), and free
heap is never handed back (``M_TRIM_THRESHOLD`` -1, which mallopt(3) documents as turning
trimming off; a threshold of 2 GiB, the largest ``mallopt`` takes, left a 100,000-rank job half
the gain). Resident memory then stays near the peak that every window reaches, which is
higher: 12–14% in the benchmark's whole job at 10,240 and 100,000 ranks, the embedded store's
freed memory kept too; flat over 60 windows (``benchmarks/README.md``).

Only for a process that runs the stream job on its own (``trainscope pipeline``), never for a
training process: a library must not change its host's allocator. Elsewhere than glibc (musl,
macOS) it does nothing; ``TRAINSCOPE_KEEP_FREED_MEMORY=0`` leaves the allocator as it is.

An earlier setting kept only blocks up to 32 MiB on the heap; it cut the page faults of a
10,240-rank window by two thirds, but not the CPU time measurably, because the blocks that
matter are larger.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

TRIM_NEVER = -1
MMAP_MAX = 0

# Set to 0 to leave the allocator as it is.
ENV_VARIABLE = "TRAINSCOPE_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Apply the settings above; whether they were applied (False off glibc, or when
    ``TRAINSCOPE_KEEP_FREED_MEMORY=0``)."""
    if os.environ.get(ENV_VARIABLE, "1").strip() == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        applied = all(libc.mallopt(parameter, value) == 1 for parameter, value in (
            (_M_MMAP_MAX, MMAP_MAX),
            (_M_TRIM_THRESHOLD, TRIM_NEVER),
        ))
    except (OSError, AttributeError) as exc:  # no libc to load, or one without mallopt
        log.debug("allocator left as it is: %s", exc)
        return False
    if not applied:
        log.debug("allocator: mallopt refused a setting; left partly as it was")
    return applied
