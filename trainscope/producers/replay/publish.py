"""Publish replayed records on the bus the way a live rank would: batches keyed by job/rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainscope.schemas.codec import encode_batch
from trainscope.streams.bus import EVENTS_TOPIC, Bus, rank_key

BATCH_RECORDS = 500


def publish_records(bus: Bus, job_id: str, records: Sequence[Any]) -> int:
    """Publish records grouped per rank (one key per rank keeps a rank's order); returns count."""
    by_rank: dict[int, list[Any]] = {}
    for record in records:
        by_rank.setdefault(getattr(record, "rank", -1), []).append(record)
    sent = 0
    for rank, items in sorted(by_rank.items()):
        key = rank_key(job_id, rank)
        for lo in range(0, len(items), BATCH_RECORDS):
            chunk = items[lo : lo + BATCH_RECORDS]
            bus.publish(EVENTS_TOPIC, encode_batch(chunk), key=key)
            sent += len(chunk)
    bus.flush()
    return sent
