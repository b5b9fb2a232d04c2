"""Bounds on the work one job can make a stream job do: distinct functions per window, open
windows.

The window engine keeps a row per (rank, function) of each open window, and a detector's cost
grows with them (peer-diff's with the functions: a few ms each). A producer that sends many
distinct function names (a bug that puts an id in the name, or a hostile one) would otherwise
hold the poll loop for minutes and grow without bound. So every message is admitted, whole or
not at all, before it is windowed, against three caps (:class:`Caps`):

- distinct functions (layer, name, call path) per rank and window;
- distinct functions per job and window, all ranks together;
- open windows per job.

The defaults are far above real jobs (a large one names a few hundred to a few thousand
functions per rank and window, keeps two or three windows open). A message that would go over
one is set aside as a dead letter with the reason (:class:`Refusal`), counted, and reported as a
``cardinality`` finding about its job (see :class:`~trainscope.engine.core.StreamCore`).

What is admitted depends on the order messages arrive in, which is the order of each partition
(a re-read after a restart admits the same messages), except across a restart: what the guard
counted is not checkpointed, so after one, the windows still open may take up to one cap more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas.records import (
    FunctionSummary,
    MetricSample,
    Record,
    SpanBatch,
    StepRecord,
    SummaryBatch,
)

FunctionKey = tuple[str, str, int]  # layer, name, call path


@dataclass(frozen=True)
class Caps:
    """``functions_per_rank``: distinct functions of one rank in one window;
    ``functions_per_job``: of all of a job's ranks in one window; ``open_windows``: windows of
    one job open at once."""

    functions_per_rank: int = 16_384
    functions_per_job: int = 65_536
    open_windows: int = 128

    def __post_init__(self) -> None:
        for name in ("functions_per_rank", "functions_per_job", "open_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Refusal:
    """Why a message was not admitted: the cap it would pass, for which job, rank and window."""

    job_id: str
    rank: int
    window_start_ns: int
    rows: int  # summary rows and span events of the message
    new_functions: int  # functions it would have added to the rank's window
    reason: str


@dataclass
class _Window:
    """The distinct functions of one open window: job-wide ids, and which each rank named."""

    ids: dict[FunctionKey, int] = field(default_factory=dict)
    ranks: dict[int, np.ndarray] = field(default_factory=dict)  # per rank: a mask over ids
    counts: dict[int, int] = field(default_factory=dict)  # per rank: functions named


# What a message names, per job: per window, per rank, its function keys (empty for steps and
# metrics, which only open windows), and its rows.
_Named = dict[str, dict[int, dict[int, set[FunctionKey]]]]


class CapGuard:
    """Admits messages against :class:`Caps`; keeps, per job and open window, the functions
    each rank named. ``closed_before(job_id)`` is the window engine's: windows below it are
    closed, forgotten here, and records for them are the engine's to count as late."""

    def __init__(self, caps: Caps, window_ns: int, closed_before: Callable[[str], int]) -> None:
        self.caps = caps
        self.window_ns = window_ns
        self._closed_before = closed_before
        self._jobs: dict[str, dict[int, _Window]] = {}

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def has_open(self, job_id: str) -> bool:
        """Whether messages of the job were admitted to a window still open."""
        windows = self._jobs.get(job_id)
        if not windows:
            return False
        closed_before = self._closed_before(job_id)
        return any(index >= closed_before for index in windows)

    def closed(self, job_id: str, window_start_ns: int) -> None:
        """A window of the job closed: what its ranks named is no longer needed."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.pop(window_start_ns // self.window_ns, None)
            if not job:
                del self._jobs[job_id]

    def admit(self, records: list[Record]) -> Refusal | None:
        """Record what the message's records name and return None, or return why not (and
        record nothing): the message goes over a cap."""
        named, rows = self._named(records)
        plans: list[tuple[dict[int, _Window], int, int, list[FunctionKey]]] = []
        for job_id, windows in named.items():
            job = self._jobs.setdefault(job_id, {})
            closed_before = self._closed_before(job_id)
            for index in [i for i in job if i < closed_before]:
                del job[index]
            fresh = [i for i in windows if i >= closed_before and i not in job]
            if fresh and len(job) + len(fresh) > self.caps.open_windows:
                rank = _busiest(windows[fresh[0]])
                return Refusal(job_id, rank, fresh[0] * self.window_ns, rows.get(job_id, 0), 0,
                               f"job {job_id!r}: would open window {fresh[0] * self.window_ns} "
                               f"with {len(job)} of its windows open already, over the cap of "
                               f"{self.caps.open_windows} (--max-open-windows)")
            for index, ranks in windows.items():
                if index < closed_before:
                    continue
                refusal = self._check(job_id, job.get(index), index, ranks, rows.get(job_id, 0))
                if refusal is not None:
                    return refusal
                plans += [(job, index, rank, list(keys)) for rank, keys in ranks.items()]
        for job, index, rank, keys in plans:
            _record(job.setdefault(index, _Window()), rank, keys)
        return None

    def _check(self, job_id: str, window: _Window | None, index: int,
               ranks: dict[int, set[FunctionKey]], rows: int) -> Refusal | None:
        known = window.ids if window is not None else {}
        added: set[FunctionKey] = set()
        for rank, keys in ranks.items():
            new = _new_for_rank(window, rank, keys)
            had = window.counts.get(rank, 0) if window is not None else 0
            if had + new > self.caps.functions_per_rank:
                return Refusal(job_id, rank, index * self.window_ns, rows, new,
                               f"job {job_id!r} rank {rank} window {index * self.window_ns}: "
                               f"{new} new distinct function(s) on top of {had}, over the cap of "
                               f"{self.caps.functions_per_rank} per rank and window "
                               "(--max-functions-per-rank)")
            added.update(k for k in keys if k not in known)
        if len(known) + len(added) > self.caps.functions_per_job:
            rank = _busiest(ranks)
            return Refusal(job_id, rank, index * self.window_ns, rows, len(added),
                           f"job {job_id!r} window {index * self.window_ns}: {len(added)} new "
                           f"distinct function(s) on top of {len(known)}, over the cap of "
                           f"{self.caps.functions_per_job} per job and window "
                           "(--max-functions-per-job)")
        return None

    def _named(self, records: list[Record]) -> tuple[_Named, dict[str, int]]:
        named: _Named = {}
        rows: dict[str, int] = {}
        window_ns = self.window_ns
        for record in records:
            if isinstance(record, SummaryBatch):
                if not len(record):
                    continue
                keys = list(zip(record.layers, record.names, record.callpaths, strict=True))
                pairs = np.unique((record.column("rank").astype(np.int64) << 32)
                                  | record.column("fn").astype(np.int64))
                ranks = _windows(named, record.job_id)[record.window_start_ns // window_ns]
                for pair in pairs.tolist():
                    ranks.setdefault(pair >> 32, set()).add(keys[pair & 0xFFFFFFFF])
                rows[record.job_id] = rows.get(record.job_id, 0) + len(record)
            elif isinstance(record, FunctionSummary):
                ranks = _windows(named, record.job_id)[record.window_start_ns // window_ns]
                ranks.setdefault(record.rank, set()).add(
                    (record.layer, record.name, record.callpath_id))
                rows[record.job_id] = rows.get(record.job_id, 0) + 1
            elif isinstance(record, SpanBatch):
                self._named_spans(named, record)
                rows[record.job_id] = rows.get(record.job_id, 0) + len(record)
            elif isinstance(record, StepRecord):  # they open windows, name no function
                _windows(named, record.job_id)[record.start_ns // window_ns].setdefault(
                    record.rank, set())
            elif isinstance(record, MetricSample):
                _windows(named, record.job_id)[(record.ts_ns - 1) // window_ns].setdefault(
                    record.rank, set())
        return named, rows

    def _named_spans(self, named: _Named, batch: SpanBatch) -> None:
        if not len(batch):
            return
        index = batch.column("start_ns") // self.window_ns
        callpath = batch.column("callpath_id") if batch.callpath_id else None
        columns = [index, batch.column("rank").astype(np.int64),
                   batch.column("fn").astype(np.int64)]
        if callpath is not None:
            columns.append(callpath.astype(np.int64))
        distinct = np.unique(np.stack(columns), axis=1)
        windows = _windows(named, batch.job_id)
        for column in distinct.T.tolist():
            path = column[3] if callpath is not None else 0
            key = (batch.layers[column[2]], batch.names[column[2]], path)
            windows[column[0]].setdefault(column[1], set()).add(key)


class _AutoDict(dict[int, dict[int, set[FunctionKey]]]):
    def __missing__(self, index: int) -> dict[int, set[FunctionKey]]:
        ranks: dict[int, set[FunctionKey]] = {}
        self[index] = ranks
        return ranks


def _windows(named: _Named, job_id: str) -> dict[int, dict[int, set[FunctionKey]]]:
    windows = named.get(job_id)
    if windows is None:
        windows = named[job_id] = _AutoDict()
    return windows


def _busiest(ranks: dict[int, set[FunctionKey]]) -> int:
    """The rank naming the most functions (the one a refusal is reported against)."""
    return max(ranks, key=lambda rank: len(ranks[rank]), default=-1)


def _new_for_rank(window: _Window | None, rank: int, keys: set[FunctionKey]) -> int:
    if window is None:
        return len(keys)
    mask = window.ranks.get(rank)
    new = 0
    for key in keys:
        fid = window.ids.get(key)
        if fid is None or mask is None or fid >= len(mask) or not mask[fid]:
            new += 1
    return new


def _record(window: _Window, rank: int, keys: list[FunctionKey]) -> None:
    fids = [window.ids.setdefault(key, len(window.ids)) for key in keys]
    mask = window.ranks.get(rank)
    if mask is None or len(mask) < len(window.ids):
        grown = np.zeros(max(len(window.ids), 2 * len(mask) if mask is not None else 0),
                         dtype=bool)
        if mask is not None:
            grown[: len(mask)] = mask
        mask = window.ranks[rank] = grown
    if fids:
        mask[fids] = True
    window.counts[rank] = int(mask.sum())
