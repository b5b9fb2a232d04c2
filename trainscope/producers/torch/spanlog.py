"""The spans of the fixed per-step phases, appended as integers on the training thread.

Forward, backward, ``optimizer.step`` and the data-loader wait happen every step. Giving each
to the :class:`WindowRecorder` directly would cost a lock, a tuple key and two dictionary
look-ups per span on the training thread; instead each phase owns one list of
``start_ns, duration_ns`` pairs, appended to (two C-level appends of the integers the clock
returned) and drained by the sender thread, which hands the durations to the recorder a chunk
at a time. Appends only ever go to the end of the list and the drain removes a prefix it
measured first, each a single C call under the GIL, so no pair is lost or read half-written
without a lock.

A list rather than an ``array('q')``: an array converts each appended integer through the
argument parser (about 95 ns an append here, 600 ns the six values of a step record, against
26 and 100 ns for a list; under callgrind a sixth of the training thread's extra instructions
per step). A list keeps the integer objects until the drain, about 40 bytes a value instead
of 8: a sender round (0.5 s) holds a few thousand, and the bound below caps a log nobody
drains at about 20 MB.

A span belongs to the window its step started in, as with :meth:`WindowRecorder.add`; a pair
drained after its window was condensed becomes a second, mergeable summary, as a late span
always did.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from trainscope.schemas.recorder import WindowRecorder

# Past this many pairs waiting (the sender thread not draining: stuck, or gone) a phase's log
# is cleared and the pairs counted as dropped, so memory stays bounded.
MAX_PENDING_PAIRS = 1 << 18


class IntLog:
    """Records of ``width`` integers appended on the training thread, taken by the sender.

    The training thread appends whole records to ``values`` (C-level appends: no lock, nothing
    allocated per record); :meth:`take` removes the complete records it measured first. Past
    ``max_pending`` records waiting, :meth:`bound` clears the log and counts them dropped.
    """

    __slots__ = ("dropped", "max_pending", "values", "width")

    def __init__(self, width: int, max_pending: int) -> None:
        self.width = width
        self.max_pending = max_pending
        self.values: list[int] = []
        self.dropped = 0

    def pending(self) -> int:
        return len(self.values) // self.width

    def bound(self) -> None:
        """Clear the log when it holds more than ``max_pending`` records (training thread)."""
        values = self.values
        size = len(values)
        if size > self.width * self.max_pending:
            n = size - size % self.width
            del values[:n]
            self.dropped += n // self.width

    def take(self) -> list[int]:
        """The complete records waiting, removed from the log (sender thread); a record whose
        last values are not appended yet stays for next time."""
        values = self.values
        # The length read once: the training thread may append the first value of a record
        # between two reads, and a chunk cut from two would end mid-record, pairing every
        # later start with the previous duration.
        size = len(values)
        n = size - size % self.width
        chunk = values[:n]
        del values[:n]
        return chunk

    def clear(self) -> None:
        del self.values[:]


class PhaseLog(IntLog):
    """One fixed phase (``layer``/``name``): its ``start_ns, duration_ns`` pairs not yet drained."""

    __slots__ = ("layer", "name")

    def __init__(self, layer: str, name: str) -> None:
        super().__init__(2, MAX_PENDING_PAIRS)
        self.layer = layer
        self.name = name

    def drain_into(self, recorder: WindowRecorder) -> int:
        """Move the complete pairs to ``recorder`` (sender thread); returns how many."""
        chunk = self.take()
        if not chunk:
            return 0
        starts = chunk[0::2]
        durations = chunk[1::2]
        window_of = recorder.window_of
        first = window_of(min(starts))
        if first == window_of(max(starts)):
            recorder.extend(self.layer, self.name, first, durations)
        elif _ascending(starts):
            # Straddling a window boundary (one round in four with 2-s windows): a window is
            # a run of neighbours, each run's end found by bisection (a span's window never
            # falls as its start rises), then handed over whole.
            lo, n = 0, len(starts)
            while lo < n:
                window = window_of(starts[lo])
                hi = bisect_right(range(n), window, lo=lo, key=lambda i: window_of(starts[i]))
                recorder.extend(self.layer, self.name, window, durations[lo:hi])
                lo = hi
        else:  # the wall clock stepped back within the chunk: span by span
            for start, duration in zip(starts, durations, strict=True):
                recorder.add(self.layer, self.name, start, duration)
        return len(chunk) // 2


def _ascending(values: list[int]) -> bool:
    return len(values) < 2 or bool((np.diff(np.array(values, dtype=np.int64)) >= 0).all())
