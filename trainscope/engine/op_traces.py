"""Op traces from the bus, taken in by the stream job and written to the store, so that
``trainscope whatif --job J`` can analyse a job that sent its trace live.

The PyTorch producer (``attach(optrace=True)``) and ``trainscope replay optrace`` send a job's
what-if op trace on a topic of its own (:data:`~trainscope.schemas.topics.OPTRACE_TOPIC`): a
rank's ops of some steps per message, each message with the job's sizes. ``trainscope
pipeline`` reads that topic beside its input. The ops feed no window: they are kept until the
stream job commits (every few seconds) or ``MAX_PENDING_OPS`` wait, then validated by job and
written, one write per job, before their positions are committed (a write per poll would give
a large job's store tens of small inserts a second). A message read again after a restart is
stored once: ``op_traces`` replaces rows of the same op and is read with FINAL.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import pandas as pd

from trainscope.schemas.optrace import JobMeta, TraceError, validate
from trainscope.schemas.whatif import TRACE_COLUMNS, OpTraceBatch, OpTraceJob, decode_optrace
from trainscope.transport.bus import Message

if TYPE_CHECKING:
    from trainscope.engine.core import StageCounts

# Ops kept before they are written whether or not a commit is due: bounds the memory they
# hold (a decoded op is a few hundred bytes).
MAX_PENDING_OPS = 200_000
# Jobs whose declared sizes are remembered, to refuse a message that contradicts them: a
# long-running stream job sees jobs come and go, so the least recently seen are let go.
MAX_JOBS_REMEMBERED = 4096


@dataclass
class _JobPart:
    job: OpTraceJob
    meta: JobMeta
    batches: list[tuple[Message, OpTraceBatch]] = field(default_factory=list)


class OpTraceIntake:
    """Op-trace messages: decoded and checked as they come (:meth:`take`), then validated by
    job, together, when they are to be written (:meth:`validated`). ``counts`` counts ops:
    ``received`` in decoded messages, ``rejected`` in messages set aside (the stream job counts
    the rest)."""

    def __init__(self, counts: StageCounts) -> None:
        self.counts = counts
        self._parts: dict[str, _JobPart] = {}
        # Per job, the sizes its first message declared, and them checked.
        self._sizes: OrderedDict[str, tuple[OpTraceJob, JobMeta]] = OrderedDict()
        self.pending_ops = 0

    def __bool__(self) -> bool:
        return bool(self._parts)

    def full(self) -> bool:
        """So many ops wait that they are written now, commit or not."""
        return self.pending_ops >= MAX_PENDING_OPS

    def take(self, message: Message) -> str | None:
        """Keep ``message`` for this part's write; the reason it is refused, if it is."""
        try:
            batch = decode_optrace(message.value)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"op trace: {exc}"
        except Exception as exc:  # decoding raises only those two; never die on input
            return f"op trace: decoding raised {type(exc).__name__}: {exc}"
        job = batch.job
        self.counts.received += len(batch.records)
        error = self._check_job(batch)
        if error is not None:
            self.counts.rejected += len(batch.records)
            return f"op trace of job {job.job_id!r}: {error}"
        part = self._parts.get(job.job_id)
        if part is None:
            part = self._parts[job.job_id] = _JobPart(job, self._sizes[job.job_id][1])
        part.batches.append((message, batch))
        self.pending_ops += len(batch.records)
        return None

    def _check_job(self, batch: OpTraceBatch) -> str | None:
        job = batch.job
        if not job.job_id:
            return "an empty job id"
        other = next((r.job_id for r in batch.records if r.job_id != job.job_id), None)
        if other is not None:
            return f"an op of job {other!r} in its message"
        known = self._sizes.get(job.job_id)
        if known is None or known[0] != job:  # sizes not seen yet: checked once
            try:
                meta = JobMeta.from_mapping(msgspec.structs.asdict(job), "its sizes")
            except TraceError as exc:
                return str(exc)
            if known is not None:
                return (f"its sizes {_sizes(job)} differ from its earlier messages' "
                        f"{_sizes(known[0])}")
            self._sizes[job.job_id] = (job, meta)
        self._sizes.move_to_end(job.job_id)
        if len(self._sizes) > MAX_JOBS_REMEMBERED:
            self._sizes.popitem(last=False)
        return None

    def validated(self, reject: Callable[[Message, str], None]
                  ) -> Iterator[tuple[OpTraceJob, pd.DataFrame, int]]:
        """Each job's ops taken since the last call as one validated frame, with the number of
        messages it holds; a message whose ops do not validate goes to ``reject`` with the
        reason, the others are kept."""
        parts, self._parts = self._parts, {}
        self.pending_ops = 0
        for job_id, part in parts.items():
            where = f"op trace of job {job_id!r}"
            try:
                frame = validate(_frame(part.batches), part.meta, where, whole=False)
                messages = len(part.batches)
            except Exception:  # TraceError, or anything else a hostile value sets off
                frame, messages = self._message_by_message(part, where, reject)
            if messages:
                yield part.job, frame, messages

    def _message_by_message(self, part: _JobPart, where: str,
                            reject: Callable[[Message, str], None]) -> tuple[pd.DataFrame, int]:
        kept = []
        for message, batch in part.batches:
            try:
                kept.append(validate(_frame([(message, batch)]), part.meta, where, whole=False))
            except Exception as exc:
                self.counts.rejected += len(batch.records)
                reason = (str(exc) if isinstance(exc, TraceError)
                          else f"{where}: validation raised {type(exc).__name__}: {exc}")
                reject(message, reason)
        return (pd.concat(kept, ignore_index=True) if kept else pd.DataFrame()), len(kept)


def _frame(batches: list[tuple[Message, OpTraceBatch]]) -> pd.DataFrame:
    """The ops of ``batches`` as a trace table (the columns of a trace file)."""
    # An op's fields are v, job_id, then TRACE_COLUMNS in order (schemas/whatif.py). Columns
    # built apart: pandas infers each from Python objects 2x slower from rows.
    rows = [msgspec.structs.astuple(r)[2:] for _, b in batches for r in b.records]
    columns = zip(*rows, strict=True) if rows else [()] * len(TRACE_COLUMNS)
    return pd.DataFrame({name: np.array(values, dtype=object if name == "optype" else None)
                         for name, values in zip(TRACE_COLUMNS, columns, strict=True)})


def _sizes(job: OpTraceJob) -> str:
    return (f"dp {job.dp_size} × pp {job.pp_size} × tp {job.tp_size} × dsp {job.dsp_size} "
            f"(vpp {job.vpp_size}, world {job.world_size})")
