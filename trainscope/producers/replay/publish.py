"""Publish replayed records on the bus the way a live rank would: batches keyed by job/rank,
through the same :class:`~trainscope.transport.outbox.Outbox` as every producer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainscope.schemas.records import SummaryBatch
from trainscope.transport.bus import Bus, BusError, rank_key
from trainscope.transport.outbox import DEFAULT_BATCH_RECORDS, Outbox

# Rows per message (a summary batch weighs its rows), as the live producer sends them.
BATCH_RECORDS = DEFAULT_BATCH_RECORDS
DELIVERY_TIMEOUT_S = 30.0


def publish_records(
    bus: Bus, job_id: str, records: Sequence[Any], timeout_s: float = DELIVERY_TIMEOUT_S
) -> int:
    """Publish records grouped per rank (one key per rank keeps a rank's order) and wait for
    the bus to acknowledge them; returns the number of records published, i.e. acknowledged (a
    summary batch is one record). Raises :class:`BusError` when some were not acknowledged
    within ``timeout_s``: a command reports that, unlike a live producer. ``bus`` stays the
    caller's to close."""
    by_rank: dict[int, list[Any]] = {}
    for record in records:
        by_rank.setdefault(_rank(record), []).append(record)

    def fill(outbox: Outbox) -> None:
        for rank, items in sorted(by_rank.items()):
            outbox.offer_many(items, rank_key(job_id, rank))

    return _deliver_all(bus, len(records), fill, timeout_s)


def publish_encoded(
    bus: Bus,
    topic: str,
    messages: Sequence[tuple[bytes | None, bytes]],
    timeout_s: float = DELIVERY_TIMEOUT_S,
) -> int:
    """Publish messages already encoded (``(key, payload)``, e.g. an op trace's chunks) through
    the same outbox and wait for their acknowledgements; returns how many were acknowledged,
    raises :class:`BusError` as :func:`publish_records` does."""

    def fill(outbox: Outbox) -> None:
        for key, payload in messages:
            outbox.offer_encoded(topic, key, payload, records=1)

    return _deliver_all(bus, len(messages), fill, timeout_s)


def _deliver_all(bus: Bus, total: int, fill: Any, timeout_s: float) -> int:
    # Room for all of them: the records are in memory already, and none may be dropped.
    outbox = Outbox(
        lambda: bus,
        capacity=max(total, 1),
        batch_records=BATCH_RECORDS,
        backoff_max_s=2.0,
        name="trainscope-replay",
    )
    outbox.start()
    fill(outbox)
    outbox.wait_idle(timeout_s)
    outbox.close(timeout_s=1.0)
    counts = outbox.stats()
    if counts["acked"] < total:
        raise BusError(
            f"{total - counts['acked']} of {total} records were not acknowledged "
            f"within {timeout_s:g}s ({counts['bus_errors']} bus errors)"
        )
    return int(counts["acked"])


def _rank(record: Any) -> int:
    if isinstance(record, SummaryBatch):  # replay makes one batch per rank and window
        ranks = record.column("rank")
        return int(ranks[0]) if len(ranks) else -1
    return int(getattr(record, "rank", -1))
