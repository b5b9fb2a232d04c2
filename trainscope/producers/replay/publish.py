"""Publish replayed records on the bus the way a live rank would: batches keyed by job/rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import SummaryBatch
from trainscope.schemas.summaries import message_chunks
from trainscope.transport.bus import EVENTS_TOPIC, Bus, rank_key

# Rows per message (a summary batch weighs its rows), as the live producer sends them.
BATCH_RECORDS = 500


def publish_records(bus: Bus, job_id: str, records: Sequence[Any]) -> int:
    """Publish records grouped per rank (one key per rank keeps a rank's order); returns the
    number of records sent (a summary batch is one record)."""
    by_rank: dict[int, list[Any]] = {}
    for record in records:
        by_rank.setdefault(_rank(record), []).append(record)
    sent = 0
    for rank, items in sorted(by_rank.items()):
        key = rank_key(job_id, rank)
        for chunk in message_chunks(items, BATCH_RECORDS):
            bus.publish(EVENTS_TOPIC, encode_batch(chunk), key=key)
            sent += len(chunk)
    bus.flush()
    return sent


def _rank(record: Any) -> int:
    if isinstance(record, SummaryBatch):  # replay makes one batch per rank and window
        ranks = record.column("rank")
        return int(ranks[0]) if len(ranks) else -1
    return int(getattr(record, "rank", -1))
