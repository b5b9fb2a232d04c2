"""Python's cycle collector paused while the stream job takes in a poll.

A poll decodes tens of thousands of small objects (a batch, its columns' bytes, lists per
message) that live until the poll is windowed, and the engine keeps millions more between
polls (each open window's rows, per-rank tables). The collector runs after every 700 net
allocations and, every tenth and hundredth time, walks the older generations too: a poll of
20,000 messages spent a fifth of its CPU in it (bench_pipeline.py at 10,240 ranks), for
objects that reference counting frees anyway. Paused for the poll and resumed after it, the
collector still runs, once the poll is done, over whatever cycles it left.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs with the cycle collector disabled; it is enabled again after, unless it
    was disabled before (by the caller, or by an outer pause). Process-wide: another thread
    allocating meanwhile is not collected either, for as long as the block runs."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
