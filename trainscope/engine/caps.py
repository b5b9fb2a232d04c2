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
    MetricBatch,
    MetricSample,
    Record,
    SpanBatch,
    StepBatch,
    StepRecord,
    SummaryBatch,
)

FunctionKey = tuple[str, str, int]  # layer, name, call path
_DictionaryKey = tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]


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
    """What one open window's ranks named: job-wide function ids, all ranks together (a mask
    by id: a message's new functions are then one lookup, where a set operation on sorted ids
    cost tens of µs a message) and each rank's (sorted)."""

    named: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # by id
    functions: int = 0  # distinct functions named, all ranks together
    ranks: dict[int, np.ndarray] = field(default_factory=dict)

    def new_among(self, fids: np.ndarray) -> int:
        """How many of ``fids`` (distinct) no rank named in the window yet."""
        known = fids < len(self.named)
        return len(fids) - int(np.count_nonzero(self.named[fids[known]]))

    def name(self, fids: np.ndarray, top: int | None = None) -> None:
        """``fids`` (distinct) are named in the window; ``top``, their largest, where the
        caller knows it already."""
        if not len(fids):
            return
        if top is None:
            top = int(fids.max())
        if top >= len(self.named):
            grown = np.zeros(max(2 * len(self.named), top + 1, 64), dtype=bool)
            grown[: len(self.named)] = self.named
            self.named = grown
        self.functions += self.new_among(fids)
        self.named[fids] = True


@dataclass
class _Job:
    """A job's function ids (a function admitted once keeps its id) and its open windows."""

    ids: dict[FunctionKey, int] = field(default_factory=dict)
    # Ids of the batches' function dictionaries seen lately: each rank sends the same one
    # window after window, so a message costs one lookup instead of one per function.
    dictionaries: dict[_DictionaryKey, np.ndarray] = field(default_factory=dict)
    # The ids a dictionary names, sorted and distinct, and their largest: what a batch names
    # when its rows are the dictionary's functions in order (the producers' batches).
    in_order: dict[_DictionaryKey, tuple[np.ndarray, int]] = field(default_factory=dict)
    windows: dict[int, _Window] = field(default_factory=dict)

    def named_in_order(self, key: _DictionaryKey, table: np.ndarray) -> tuple[np.ndarray, int]:
        known = self.in_order.get(key)
        if known is None:
            if len(self.in_order) >= _MAX_DICTIONARIES:
                self.in_order.clear()
            fids = _distinct(table)
            known = self.in_order[key] = (fids, int(fids.max()) if len(fids) else -1)
        return known


_EMPTY = np.zeros(0, dtype=np.int64)
_UNDECIDED = object()  # a fast path's "take the general path"
_MAX_DICTIONARIES = 4096
# Per window, per rank: the function ids the message names there (arrays, maybe repeating).
_Named = dict[int, dict[int, list[np.ndarray]]]


class _Message:
    """What one message names, per job: function ids (new functions get the ids they would
    have once admitted) by window and rank, its rows, and the functions new to the job."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.named: _Named = {}
        self.rows = 0
        self.new: dict[FunctionKey, int] = {}

    def fid(self, key: FunctionKey) -> int:
        fid = self.job.ids.get(key)
        if fid is None:
            fid = self.new.setdefault(key, len(self.job.ids) + len(self.new))
        return fid

    def table(self, layers: list[str], names: list[str], callpaths: list[int]) -> np.ndarray:
        key = (tuple(layers), tuple(names), tuple(callpaths))
        table = self.job.dictionaries.get(key)
        if table is None:
            new_before = len(self.new)
            table = np.array([self.fid(k) for k in zip(*key, strict=True)], dtype=np.int64)
            if len(self.new) == new_before:  # all known: the ids are final
                if len(self.job.dictionaries) >= _MAX_DICTIONARIES:
                    self.job.dictionaries.clear()
                self.job.dictionaries[key] = table
        return table

    def add(self, index: int, rank: np.ndarray | int, fid: np.ndarray) -> None:
        """Rows of window ``index``: their ranks (one for all, or one each) and function ids."""
        ranks = self.named.setdefault(index, {})
        if isinstance(rank, int):
            ranks.setdefault(rank, []).append(fid)
            return
        if len(rank) and (rank == rank[0]).all():
            ranks.setdefault(int(rank[0]), []).append(fid)
            return
        order = np.argsort(rank, kind="stable")
        bounds = np.flatnonzero(np.r_[True, rank[order][1:] != rank[order][:-1]])
        for rows in np.split(order, bounds[1:]):
            ranks.setdefault(int(rank[rows[0]]), []).append(fid[rows])


class CapGuard:
    """Admits messages against :class:`Caps`; keeps, per job and open window, the functions
    each rank named. ``closed_before(job_id)`` is the window engine's: windows below it are
    closed, forgotten here, and records for them are the engine's to count as late.

    A job's function ids live as long as the job (like the window engine's function table):
    its windows hold sorted arrays of ids, 8 bytes per (rank, function) named."""

    def __init__(self, caps: Caps, window_ns: int, closed_before: Callable[[str], int]) -> None:
        self.caps = caps
        self.window_ns = window_ns
        self._closed_before = closed_before
        self._jobs: dict[str, _Job] = {}

    def forget(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def has_open(self, job_id: str) -> bool:
        """Whether messages of the job were admitted to a window still open."""
        job = self._jobs.get(job_id)
        if job is None or not job.windows:
            return False
        closed_before = self._closed_before(job_id)
        return any(index >= closed_before for index in job.windows)

    def closed(self, job_id: str, window_start_ns: int) -> None:
        """A window of the job closed: what its ranks named is no longer needed."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.windows.pop(window_start_ns // self.window_ns, None)

    def admit(self, records: list[Record]) -> Refusal | None:
        """Record what the message's records name and return None, or return why not (and
        record nothing): the message goes over a cap."""
        if len(records) == 1:
            record = records[0]
            kind = type(record)
            if kind in (StepBatch, MetricBatch) and len(record) == 1:
                return self._admit_one_row(record)
            if kind is SummaryBatch:
                verdict = self._admit_summaries(record)
                if verdict is not _UNDECIDED:
                    return verdict
        return self._admit_named(records)

    def _admit_summaries(self, batch: SummaryBatch) -> Refusal | object | None:
        """:meth:`admit` for the usual summary message — one rank's batch for one window, its
        function dictionary known to the job (each rank sends the same one window after
        window) — without the general path's per-message tables; ``_UNDECIDED`` for any
        other, left to the general path."""
        job = self._jobs.get(batch.job_id)
        raw_rank = batch.rank
        first = raw_rank[:4]
        # One rank's rows (a bytes comparison: numpy's per call costs more on 60 values).
        if job is None or len(first) < 4 or raw_rank != first * (len(raw_rank) // 4):
            return _UNDECIDED
        rank = int.from_bytes(first, "little", signed=True)
        key = (tuple(batch.layers), tuple(batch.names), tuple(batch.callpaths))
        table = job.dictionaries.get(key)
        if table is None:
            return _UNDECIDED  # names new to the job: their ids are given in _named
        index = batch.window_start_ns // self.window_ns
        late, refusal = self._late_or_over(batch.job_id, job, index, rank, len(batch))
        if late or refusal is not None:
            return refusal
        window = job.windows.get(index)
        if batch.fn == _in_order(len(batch)):
            fids, top = job.named_in_order(key, table)
        else:
            fids, top = _distinct(table[batch.column("fn")]), None
        refusal = self._check(batch.job_id, window, index, {rank: fids}, len(batch))
        if refusal is not None:
            return refusal
        if window is None:
            window = job.windows[index] = _Window()
        _name(window, rank, fids, top)
        return None

    def _admit_named(self, records: list[Record]) -> Refusal | None:
        """:meth:`admit` for any message."""
        messages = self._named(records)
        updates: list[tuple[_Job, int, int, np.ndarray]] = []
        for job_id, message in messages.items():
            job = message.job
            closed_before = self._closed_before(job_id)
            _forget_closed(job, closed_before)
            named = {i: ranks for i, ranks in message.named.items() if i >= closed_before}
            fresh = [i for i in named if i not in job.windows]
            if fresh and len(job.windows) + len(fresh) > self.caps.open_windows:
                return self._over_open_windows(job_id, job, fresh[0],
                                               _busiest(named[fresh[0]]), message.rows)
            for index, ranks in named.items():
                distinct = {rank: _distinct(np.concatenate(fids)) if len(fids) > 1
                            else _distinct(fids[0]) for rank, fids in ranks.items()}
                # Step records and metric samples name no function: only the open windows'
                # cap (above) applies to them.
                if any(len(fids) for fids in distinct.values()):
                    refusal = self._check(job_id, job.windows.get(index), index, distinct,
                                          message.rows)
                    if refusal is not None:
                        return refusal
                updates += [(job, index, rank, fids) for rank, fids in distinct.items()]
        for message in messages.values():
            message.job.ids.update(message.new)
        for job, index, rank, fids in updates:
            window = job.windows.get(index)
            if window is None:
                window = job.windows[index] = _Window()
            _name(window, rank, fids)
        return None

    def _admit_one_row(self, record: StepBatch | MetricBatch) -> Refusal | None:
        """:meth:`admit` for a message of one step record or metric sample (a rank's step of
        a sender round: nine in ten messages), which names no function and opens at most one
        window; the general path cost ten times as much."""
        if isinstance(record, StepBatch):
            index = int(record.column("start_ns")[0]) // self.window_ns
        else:
            index = (int(record.column("ts_ns")[0]) - 1) // self.window_ns
        return self.admit_row(record.job_id, index, int(record.column("rank")[0]))

    def admit_row(self, job_id: str, index: int, rank: int) -> Refusal | None:
        """:meth:`admit` for a message of one step record or metric sample of ``rank`` in
        window ``index`` (its producer's clock), its values read already."""
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job()
        late, refusal = self._late_or_over(job_id, job, index, rank, 0)
        if late or refusal is not None:
            return refusal
        window = job.windows.get(index)
        if window is None:
            window = job.windows[index] = _Window()
        window.ranks.setdefault(rank, _EMPTY)
        return None

    def opens_nothing(self, job_id: str, indices: list[int]) -> set[int]:
        """Of windows ``indices`` of the job (its producers' clock), those a row is admitted
        into without opening a window: closed (its rows are late) or open already. Such rows
        pass the caps whatever else a poll admits, so they may be admitted together
        (:meth:`note_ranks`)."""
        job = self._jobs.get(job_id)
        closed_before = self._closed_before(job_id)
        return {index for index in indices
                if index < closed_before or (job is not None and index in job.windows)}

    def note_ranks(self, job_id: str, index: int, ranks: list[int]) -> None:
        """What :meth:`admit_row` records of rows of ``ranks`` admitted into window ``index``
        of :meth:`opens_nothing`."""
        job = self._jobs.get(job_id)
        if job is None:
            job = self._jobs[job_id] = _Job()
        if index < self._closed_before(job_id):
            return  # closed: late rows name nothing
        setdefault = job.windows[index].ranks.setdefault
        for rank in ranks:
            setdefault(rank, _EMPTY)

    def _late_or_over(self, job_id: str, job: _Job, index: int, rank: int, rows: int
                      ) -> tuple[bool, Refusal | None]:
        """Whether the job's window ``index`` is closed (its rows are late: the window engine
        counts them, nothing to admit), and else the refusal if opening it would pass the
        open-windows cap (None: admit)."""
        closed_before = self._closed_before(job_id)
        if index < closed_before:
            return True, None
        if index not in job.windows:
            _forget_closed(job, closed_before)
            if len(job.windows) + 1 > self.caps.open_windows:
                return False, self._over_open_windows(job_id, job, index, rank, rows)
        return False, None

    def _over_open_windows(self, job_id: str, job: _Job, index: int, rank: int, rows: int
                           ) -> Refusal:
        return Refusal(job_id, rank, index * self.window_ns, rows, 0,
                       f"job {job_id!r}: would open window {index * self.window_ns} with "
                       f"{len(job.windows)} of its windows open already, over the cap of "
                       f"{self.caps.open_windows} (--max-open-windows)")

    def _check(self, job_id: str, window: _Window | None, index: int,
               ranks: dict[int, np.ndarray], rows: int) -> Refusal | None:
        for rank, fids in ranks.items():
            old = window.ranks.get(rank) if window is not None else None
            had = 0 if old is None else len(old)
            new = len(fids) if not had else int((~np.isin(fids, old, assume_unique=True)).sum())
            if had + new > self.caps.functions_per_rank:
                return Refusal(job_id, rank, index * self.window_ns, rows, new,
                               f"job {job_id!r} rank {rank} window {index * self.window_ns}: "
                               f"{new} new distinct function(s) on top of {had}, over the cap of "
                               f"{self.caps.functions_per_rank} per rank and window "
                               "(--max-functions-per-rank)")
        # One rank's ids are distinct already (the usual message: a rank's summaries).
        named = (next(iter(ranks.values())) if len(ranks) == 1
                 else _distinct(np.concatenate(list(ranks.values()))))
        known = window.functions if window is not None else 0
        added = window.new_among(named) if window is not None else len(named)
        if known + added > self.caps.functions_per_job:
            return Refusal(job_id, _busiest(ranks), index * self.window_ns, rows, added,
                           f"job {job_id!r} window {index * self.window_ns}: {added} new "
                           f"distinct function(s) on top of {known}, over the cap of "
                           f"{self.caps.functions_per_job} per job and window "
                           "(--max-functions-per-job)")
        return None

    def _named(self, records: list[Record]) -> dict[str, _Message]:
        messages: dict[str, _Message] = {}
        window_ns = self.window_ns
        for record in records:
            if not isinstance(record, SummaryBatch | FunctionSummary | SpanBatch | StepRecord
                              | MetricSample | StepBatch | MetricBatch):
                continue
            message = messages.get(record.job_id)
            if message is None:
                job = self._jobs.get(record.job_id)
                if job is None:
                    job = self._jobs[record.job_id] = _Job()
                message = messages[record.job_id] = _Message(job)
            if isinstance(record, SummaryBatch):
                if len(record):
                    table = message.table(record.layers, record.names, record.callpaths)
                    message.add(record.window_start_ns // window_ns,
                                record.column("rank").astype(np.int64),
                                table[record.column("fn")])
                    message.rows += len(record)
            elif isinstance(record, FunctionSummary):
                fid = message.fid((record.layer, record.name, record.callpath_id))
                message.add(record.window_start_ns // window_ns, record.rank,
                            np.array([fid], dtype=np.int64))
                message.rows += 1
            elif isinstance(record, SpanBatch):
                self._named_spans(message, record)
            elif isinstance(record, StepRecord):  # they open windows, name no function
                message.add(record.start_ns // window_ns, record.rank, _EMPTY)
            elif isinstance(record, MetricSample):
                message.add((record.ts_ns - 1) // window_ns, record.rank, _EMPTY)
            elif len(record):  # a StepBatch or MetricBatch: windows opened per rank
                index = (record.column("start_ns") // window_ns if isinstance(record, StepBatch)
                         else (record.column("ts_ns") - 1) // window_ns)
                rank = record.column("rank").astype(np.int64)
                if index.min() == index.max() and rank.min() == rank.max():  # one of each
                    message.add(int(index[0]), int(rank[0]), _EMPTY)
                    continue
                for window, one in _pairs(index, rank):
                    message.add(window, one, _EMPTY)
        return messages

    def _named_spans(self, message: _Message, batch: SpanBatch) -> None:
        if not len(batch):
            return
        local_fn = batch.column("fn").astype(np.int64)
        if batch.callpath_id and batch.column("callpath_id").any():
            pairs, inverse = np.unique(np.stack([local_fn, batch.column("callpath_id")
                                                 .astype(np.int64)]), axis=1,
                                       return_inverse=True)
            ids = np.array([message.fid((batch.layers[f], batch.names[f], c))
                            for f, c in pairs.T.tolist()], dtype=np.int64)
            fid = ids[inverse.ravel()]
        else:
            fid = message.table(batch.layers, batch.names, [0] * len(batch.names))[local_fn]
        index = batch.column("start_ns") // self.window_ns
        rank = batch.column("rank").astype(np.int64)
        for window in np.unique(index).tolist():
            rows = index == window
            message.add(window, rank[rows], fid[rows])
        message.rows += len(batch)


def _in_order(rows: int) -> bytes:
    """The ``fn`` column of a batch whose rows are its dictionary's functions in order."""
    column = _IN_ORDER.get(rows)
    if column is None:
        if len(_IN_ORDER) >= _MAX_DICTIONARIES:
            _IN_ORDER.clear()
        column = _IN_ORDER[rows] = np.arange(rows, dtype="<i4").tobytes()
    return column


_IN_ORDER: dict[int, bytes] = {}


def _name(window: _Window, rank: int, fids: np.ndarray, top: int | None = None) -> None:
    """``rank`` named ``fids`` (distinct, sorted; ``top`` their largest if known) in
    ``window``."""
    old = window.ranks.get(rank)
    if old is None or not len(old):
        window.ranks[rank] = fids
    elif len(fids):
        window.ranks[rank] = _distinct(np.concatenate([old, fids]))
    window.name(fids, top)


def _forget_closed(job: _Job, closed_before: int) -> None:
    """The job's windows below ``closed_before`` closed: what their ranks named goes."""
    for index in [i for i in job.windows if i < closed_before]:
        del job.windows[index]


def _distinct(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values. A sort and a comparison of neighbours: numpy 2's hash-based
    ``unique`` took ~10x longer on these arrays (as in frames.py)."""
    if len(values) < 2:
        return values
    ordered = np.sort(values)
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered if keep.all() else ordered[keep]


def _pairs(index: np.ndarray, rank: np.ndarray) -> list[tuple[int, int]]:
    """The distinct (window, rank) pairs of a batch's rows. As one int64 each — windows from
    the first, ranks (validated: in [0, 2**31)) below — and a sort: numpy's unique over pairs
    cost ~10x as much."""
    lo = int(index.min())
    if int(index.max()) - lo >= 1 << 31 or int(rank.min()) < 0:
        return [(w, r) for w, r in np.unique(np.stack([index, rank]), axis=1).T.tolist()]
    keys = _distinct(((index - lo) << 32) | rank).tolist()
    return [((key >> 32) + lo, key & 0xFFFFFFFF) for key in keys]


def _busiest(ranks: dict[int, np.ndarray] | dict[int, list[np.ndarray]]) -> int:
    """The rank naming the most functions (the one a refusal is reported against)."""
    def size(rank: int) -> int:
        value = ranks[rank]
        return len(value) if isinstance(value, np.ndarray) else sum(len(v) for v in value)
    return max(ranks, key=size, default=-1)
