"""In-process per-window accumulation of function durations, condensed into summaries.

What the PyTorch producer (``attach()``) runs in every rank, and what the simulated cluster runs
per simulated rank, so both send the same :class:`SummaryBatch` records made the same way. In
``attach()`` the training thread only appends integers under a lock; condensing a closed window
into :class:`SummaryBatch` records (numpy, sketch) happens on the sender thread. Windows are
aligned to the epoch (``window_start_ns = start_ns // window_ns * window_ns``) and a span
belongs to the window in which *its step* started, like the step's record: a window's summaries
and its step records then cover the same steps, so a function's time per step (its total over
the window's step count) is right whatever the window length. Filed by their own start instead,
a step that straddles a window boundary would put its spans in one window and its record in
the other, and with a few steps per window "ms per step" swung by up to 2x. A span before the
first step the recorder was told of belongs to the window it started in.
"""

from __future__ import annotations

import threading
from bisect import bisect_right

from trainscope.schemas.records import SummaryBatch
from trainscope.schemas.summaries import FunctionKey, summary_batches

# Step starts kept for filing spans (a span older than the oldest kept start is filed by its own
# start): trimmed to the newest KEPT_STEP_STARTS once there are twice as many.
KEPT_STEP_STARTS = 1024
# A window is condensed this long after its end (a quarter of the window if that is shorter) so
# spans still running at the boundary (a collective, a GC pause) usually land in it; later ones
# become a second, mergeable summary.
WINDOW_GRACE_S = 0.5


def window_ns_of(window_s: float) -> int:
    """A window length in nanoseconds, rounded as every producer and the engine round it, so
    they all cut the same grid."""
    return int(window_s * 1e9)


def window_start_of(ts_ns: int, window_ns: int) -> int:
    """The start of the epoch-grid window holding ``ts_ns``: a multiple of ``window_ns`` since
    the Unix epoch, whatever process or host computes it."""
    return ts_ns // window_ns * window_ns


class _Durations:
    __slots__ = ("bytes_total", "durations_ns")

    def __init__(self) -> None:
        self.durations_ns: list[int] = []
        self.bytes_total = 0


class WindowRecorder:
    """Open windows of function durations, filled by the hooks and emptied by the sender.

    Its lock is not re-entrant, and must not be: nothing that can run inside an allocation made
    under it (a ``gc.callbacks`` entry, a finalizer) may call :meth:`add`; such callers append
    to a :class:`~trainscope.producers.torch.spanlog.PhaseLog` instead.
    """

    def __init__(self, window_ns: int, grace_ns: int) -> None:
        if window_ns <= 0:
            raise ValueError(f"window_ns must be > 0, got {window_ns}")
        self.window_ns = window_ns
        # A window is closed this long after its end, so spans that started in it and are
        # still running at the boundary (a collective, a GC pause) are usually counted in it.
        self.grace_ns = grace_ns
        self.recorded = 0
        self._open: dict[int, dict[FunctionKey, _Durations]] = {}
        self._lock = threading.Lock()
        # Starts of the steps so far, ascending: appended by the training thread (one C call,
        # no lock; a list, whose append costs a quarter of an array's), read and trimmed by
        # whoever files spans.
        self.step_starts: list[int] = []

    @classmethod
    def for_window(cls, window_s: float) -> WindowRecorder:
        """A recorder of ``window_s`` windows with the producers' grace period."""
        return cls(window_ns_of(window_s), int(min(WINDOW_GRACE_S, window_s / 4) * 1e9))

    def step_started(self, start_ns: int) -> None:
        """A step began at ``start_ns``: spans from then on belong to its window."""
        starts = self.step_starts
        if not starts or start_ns >= starts[-1]:
            starts.append(start_ns)

    def window_of(self, ts_ns: int) -> int:
        """The window of the step that was running at ``ts_ns`` (of ``ts_ns`` itself before the
        first step)."""
        starts = self.step_starts
        if starts and ts_ns >= starts[-1]:  # the step in progress: the usual case
            anchor = starts[-1]
        else:
            i = bisect_right(starts, ts_ns)
            anchor = starts[i - 1] if i else ts_ns
        return anchor // self.window_ns * self.window_ns

    def add(
        self,
        layer: str,
        name: str,
        start_ns: int,
        duration_ns: int,
        bytes_moved: int = 0,
        callpath_id: int = 0,
    ) -> None:
        window = self.window_of(start_ns)
        key = (layer, name, callpath_id)
        with self._lock:
            functions = self._open.get(window)
            if functions is None:
                functions = self._open[window] = {}
            acc = functions.get(key)
            if acc is None:
                acc = functions[key] = _Durations()
            acc.durations_ns.append(duration_ns if duration_ns > 0 else 0)
            acc.bytes_total += bytes_moved
            self.recorded += 1

    def extend(
        self, layer: str, name: str, window_start_ns: int, durations_ns: list[int]
    ) -> None:
        """Many spans of one function that all belong to the window at ``window_start_ns``,
        under one lock (the PyTorch producer's drained per-phase logs)."""
        if min(durations_ns, default=0) < 0:
            durations_ns = [d if d > 0 else 0 for d in durations_ns]
        key = (layer, name, 0)
        with self._lock:
            functions = self._open.get(window_start_ns)
            if functions is None:
                functions = self._open[window_start_ns] = {}
            acc = functions.get(key)
            if acc is None:
                acc = functions[key] = _Durations()
            acc.durations_ns.extend(durations_ns)
            self.recorded += len(durations_ns)

    def take_closed(self, now_ns: int) -> list[tuple[int, dict[FunctionKey, _Durations]]]:
        """Remove and return windows that ended at least ``grace_ns`` ago."""
        starts = self.step_starts
        if len(starts) > 2 * KEPT_STEP_STARTS:
            del starts[: len(starts) - KEPT_STEP_STARTS]
        with self._lock:
            closed = [w for w in self._open if w + self.window_ns + self.grace_ns <= now_ns]
            return [(w, self._open.pop(w)) for w in sorted(closed)]

    def take_all(self) -> list[tuple[int, dict[FunctionKey, _Durations]]]:
        with self._lock:
            taken = sorted(self._open.items())
            self._open = {}
            return taken

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._open = {}
        self.step_starts = []

    def summaries(
        self,
        job_id: str,
        rank: int,
        window_start_ns: int,
        functions: dict[FunctionKey, _Durations],
    ) -> list[SummaryBatch]:
        return summary_batches(
            {key: acc.durations_ns for key, acc in functions.items()},
            job_id=job_id,
            rank=rank,
            window_start_ns=window_start_ns,
            window_end_ns=window_start_ns + self.window_ns,
            bytes_total={key: acc.bytes_total for key, acc in functions.items()},
        )
