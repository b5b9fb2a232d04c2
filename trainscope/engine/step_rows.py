"""A poll's messages of one step record each, handled as columns.

The PyTorch producer sends each sender round's steps in a message of their own: at a large
job's usual step lengths (a second or more) nine messages in ten hold one step record. Decoding
and de-duplication stay per message (each has its own stamp and position), but the rest — the
validation, the newest window each feeds, the open-windows cap's window and rank, the filing —
is done here for all of a poll's such messages at once, on their columns: message by message it
cost three times the decoding (a numpy view per column read, a validation pass and a window
look-up each, the rows packed again per partition).

What :class:`StreamCore <trainscope.engine.core.StreamCore>` does with each message is unchanged:
the same verdicts, counts, stamps kept and windows fed as if it had taken the general path
(tests/engine/test_step_rows.py compares the two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from trainscope.engine.caps import CapGuard
from trainscope.engine.delivery import SeenBatches
from trainscope.engine.windows import WindowEngine
from trainscope.schemas.records import Record, StepBatch

# ``StreamCore._validate``: per message, None or why it is rejected.
Validate = Callable[[list[list[Record]]], list[str | None]]


def one_step(records: list[Record]) -> StepBatch | None:
    """The message's step batch if the message is one step record as a batch, else None."""
    if len(records) == 1:
        record = records[0]
        if type(record) is StepBatch and len(record.rank) == 4:
            return record
    return None


class StepRows:
    """The one-step messages of a part of a poll (:meth:`add`, in message order), then, after
    :meth:`seal`, per message: its job, raw window (the caps'), rank and newest window on the
    job's clock, and :meth:`take` for a source's admitted rows of a job."""

    def __init__(self) -> None:
        self.batches: list[StepBatch] = []
        self.places: list[int] = []  # each message's place in the poll's part
        self.stamps: list[tuple[int, int, int]] = []  # producer id, sequence, payload digest
        self.job_ids: list[str] = []
        self.rank: list[int] = []
        self.raw_window: list[int] = []  # by the producer's clock (as the caps count windows)
        self.newest: list[int] = []  # on the job's clock (the window it feeds)
        self._jobs: dict[str, StepBatch] = {}  # each job's rows, in message order
        self._indices: dict[str, list[int]] = {}  # each job's messages (indices here)
        self._row_of = np.zeros(0, dtype=np.int64)  # each message's row in its job's batch

    def add(self, batch: StepBatch, place: int, stamp: tuple[int, int, int]) -> int:
        """A one-step message's batch, its place in the part and its stamp (see
        :class:`~trainscope.engine.delivery.SeenBatches`); returns its index here."""
        self.batches.append(batch)
        self.places.append(place)
        self.stamps.append(stamp)
        return len(self.batches) - 1

    def seal(self, engine: WindowEngine) -> None:
        """Each job's rows as one batch, and each message's windows and rank from it, with the
        clock offsets the engine knows now (as each message's would be read before filing)."""
        by_job = self._indices
        for index, batch in enumerate(self.batches):
            by_job.setdefault(batch.job_id, []).append(index)
        count = len(self.batches)
        job_ids: list[str] = [""] * count
        rank = np.empty(count, dtype=np.int64)
        raw = np.empty(count, dtype=np.int64)
        newest = np.empty(count, dtype=np.int64)
        self._row_of = np.empty(count, dtype=np.int64)
        window_ns = engine.window_ns
        for job_id, indices in by_job.items():
            joined = StepBatch.concat([self.batches[i] for i in indices])
            at = np.asarray(indices)
            self._jobs[job_id] = joined
            self._row_of[at] = np.arange(len(at))
            ranks = joined.column("rank")
            start = joined.column("start_ns")
            rank[at] = ranks
            raw[at] = start // window_ns
            shift = engine.offsets_of(job_id, ranks)
            newest[at] = raw[at] if shift is None else (start - shift) // window_ns
            for i in indices:
                job_ids[i] = job_id
        self.job_ids = job_ids
        self.rank = rank.tolist()
        self.raw_window = raw.tolist()
        self.newest = newest.tolist()

    def errors(self, validate: Validate) -> list[str | None]:
        """Per message, None or why it is rejected: each job's rows validated as one batch,
        and only a job's whose batch fails message by message (to name the message and its
        reason as the general path would)."""
        errors: list[str | None] = [None] * len(self.batches)
        for job_id, joined in self._jobs.items():
            if validate([[joined]])[0] is None:
                continue
            indices = self._indices[job_id]
            for i, error in zip(indices, validate([[self.batches[i]] for i in indices]),
                                strict=True):
                errors[i] = error
        return errors

    def admit_apart(self, errors: list[str | None], caps: CapGuard, seen: SeenBatches,
                    others: set[tuple[int, int]]) -> tuple[list[bool], list[int]]:
        """Admit, at once, the messages whose verdict does not depend on the poll's order:
        valid, into a window that is open or closed already (:meth:`CapGuard.opens_nothing`:
        no cap can refuse them, whatever the poll's other messages open), under a stamp no
        message of ``others`` (the stamps of the poll's other messages) has, so that which
        of two batches under one stamp is kept stays the first's. Returns, per message here,
        whether it was taken apart, and the indices of those that were not re-sends (kept
        and noted with the caps); the rest go through the poll one by one, in order."""
        count = len(self.batches)
        raw, rank, job_ids, newest, stamps = (self.raw_window, self.rank, self.job_ids,
                                              self.newest, self.stamps)
        candidate = [e is None for e in errors]
        for job_id, indices in self._indices.items():
            opens_nothing = caps.opens_nothing(job_id, list({raw[i] for i in indices}))
            for i in indices:
                if raw[i] not in opens_nothing:
                    candidate[i] = False
        others = others | {stamps[i][:2] for i in range(count) if not candidate[i]}
        apart = [candidate[i] and stamps[i][:2] not in others for i in range(count)]
        taken = [i for i in range(count) if apart[i]]
        new = seen.keep_new([stamps[i] for i in taken], [job_ids[i] for i in taken],
                            [newest[i] for i in taken])
        kept = [i for i, fresh in zip(taken, new, strict=True) if fresh]
        by_window: dict[tuple[str, int], list[int]] = {}
        for i in kept:
            by_window.setdefault((job_ids[i], raw[i]), []).append(rank[i])
        for (job_id, index), ranks in by_window.items():
            caps.note_ranks(job_id, index, ranks)
        return apart, kept

    def take(self, job_id: str, indices: Sequence[int]) -> StepBatch:
        """The rows of messages ``indices`` (all of job ``job_id``), as one batch."""
        joined = self._jobs[job_id]
        if len(indices) == len(joined):
            return joined  # every message of the job (rows kept in message order)
        return joined.take(self._row_of[np.asarray(indices)])
