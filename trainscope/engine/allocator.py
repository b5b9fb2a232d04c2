"""The stream job's process keeps the memory it frees for its next window.

Each window's close allocates and frees the same large numpy arrays again (tens of MB at
10,000 ranks). With glibc's defaults, free memory above 128 KB at the top of the heap is given
back to the kernel, and blocks above a threshold that only grows after the first such free are
mapped afresh, so the next window pays the kernel again to fault in and zero the same pages:
at 10,240 ranks about 60,000 page faults and 0.5 s of system time per six windows, a tenth of
the window engine's time (``benchmarks/README.md``). Three of glibc's ``mallopt`` settings keep
that memory in the process instead: blocks up to 32 MiB (glibc's ceiling for this setting) come
from the heap, and up to 256 MiB of free heap stays mapped. Resident memory then stays near its
peak between windows, which is what the job is sized for anyway.

Only for a process that runs a stream job (``trainscope pipeline``, ``trainscope demo``), never
for a training process: a library must not change its host's allocator. Elsewhere than glibc
(musl, macOS) it does nothing.
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
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 256 << 20
TOP_PAD_BYTES = 64 << 20

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
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        ))
    except (OSError, AttributeError) as exc:  # no libc to load, or one without mallopt
        log.debug("allocator left as it is: %s", exc)
        return False
    return applied
