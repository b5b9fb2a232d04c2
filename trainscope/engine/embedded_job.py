"""The stream job fed in-process: records or messages handed to it by whoever holds it.

What runs the detector contract check (:mod:`trainscope.testing`), the benchmarks, the tests, and
each Faust worker (:mod:`trainscope.engines.faust.app`, which hands it the messages Faust
delivers). Its sibling, :class:`~trainscope.engine.bus_job.BusStreamJob`, reads a bus itself
and commits; both are built on :class:`~trainscope.engine.core.StreamCore`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable

from trainscope.engine.core import StreamCore
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import Record
from trainscope.schemas.validate import InvalidRecord

log = logging.getLogger(__name__)


class EmbeddedStreamJob(StreamCore):
    """A :class:`StreamCore` its owner feeds: :meth:`process_records` (records built in
    Python; an invalid one is rejected alone) or :meth:`process_messages` (bus messages, as a
    consumer would deliver them), then :meth:`finish` at the end of the stream. It commits
    nothing; whoever feeds it decides what a position means (see ``offsets``)."""

    def process_records(self, records: Iterable[Record], source: Hashable = 0) -> None:
        """Records handed over in-process (simulator, tests); each invalid one is rejected
        alone, with its index in ``records``, to the dead-letter table."""
        given = list(records)
        self._stats.validate.received += len(given)
        try:
            self.validator.validate(given)  # the common case: all valid, one call
        except InvalidRecord:
            accepted = self._accept_one_by_one(given)
        else:
            accepted = given
            self._stats.validate.emitted += len(given)
        for job_id, exc in self._ingest(accepted, source).items():
            for index, record in enumerate(given):
                if getattr(record, "job_id", None) == job_id:
                    self._dead_letters.append(
                        ("", -1, -1, f"records[{index}] ({type(record).__name__}): window engine "
                                     f"raised {type(exc).__name__}: {exc}", _encoded(record))
                    )
        self._flush_dead_letters()
        self._handle(self.engine.close_ready())

    def _accept_one_by_one(self, records: list[Record]) -> list[Record]:
        accepted: list[Record] = []
        for index, record in enumerate(records):
            try:
                self.validator.validate([record])
            except InvalidRecord as exc:
                self._stats.validate.rejected += 1
                reason = f"records[{index}] ({exc.kind}): {exc.detail}"
                log.warning("rejected %s; set aside as a dead letter", reason)
                self._dead_letters.append(("", -1, -1, reason, _encoded(record)))
                continue
            self._stats.validate.emitted += 1
            accepted.append(record)
        return accepted

    def finish(self) -> None:
        """End of stream: close and process every open window."""
        self.drain()


def _encoded(record: Record) -> bytes:
    try:
        return encode_batch([record])
    except Exception:  # a record built in Python may hold what msgpack cannot carry
        return b""
