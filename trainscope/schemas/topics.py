"""Topic names and partition keys: where each record goes on the bus, and with which key.

They belong with the records because producers, stream jobs and sinks must agree on them, and
none of those should import another to learn them.
"""

from __future__ import annotations

EVENTS_TOPIC = "trainscope.events"
METRICS_TOPIC = "trainscope.metrics"
CONTROL_TOPIC = "trainscope.control"
DEAD_LETTER_TOPIC = "trainscope.dead-letter"
# Window summaries and step records that a windowing tier (the PyFlink job) computed from the
# events topic, one JSON record per message, for the detection tier (`trainscope pipeline
# --input summaries`).
SUMMARIES_TOPIC = "trainscope.summaries"
ALL_TOPICS = (EVENTS_TOPIC, METRICS_TOPIC, CONTROL_TOPIC, DEAD_LETTER_TOPIC)
# What-if op traces travel in their own envelope (see trainscope.schemas.whatif.OpTraceBatch).
OPTRACE_TOPIC = "trainscope.optrace"


def rank_key(job_id: str, rank: int) -> bytes:
    return f"{job_id}/{rank}".encode()
