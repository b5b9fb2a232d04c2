"""The message bus: ``open_bus`` picks an implementation (in-memory or Kafka) from a URL.

The protocol the implementations share is :mod:`trainscope.transport.protocol`; topic names
and partition keys are :mod:`trainscope.schemas.topics`. Both are re-exported here, so producers
and stream jobs need only this module.
"""

from __future__ import annotations

from trainscope.config.secrets import redact_url
from trainscope.schemas.topics import (
    ALL_TOPICS,
    CONTROL_TOPIC,
    DEAD_LETTER_TOPIC,
    EVENTS_TOPIC,
    METRICS_TOPIC,
    rank_key,
)
from trainscope.transport.protocol import (
    DEFAULT_PARTITIONS,
    Bus,
    BusError,
    Consumer,
    DeliveryCallback,
    GroupHeldElsewhere,
    Message,
    TrackingBus,
    partition_for,
)

# The facade producers and stream jobs import; the implementations import bus_protocol instead.
__all__ = [
    "ALL_TOPICS",
    "CONTROL_TOPIC",
    "DEAD_LETTER_TOPIC",
    "DEFAULT_PARTITIONS",
    "EVENTS_TOPIC",
    "METRICS_TOPIC",
    "Bus",
    "BusError",
    "Consumer",
    "DeliveryCallback",
    "GroupHeldElsewhere",
    "Message",
    "TrackingBus",
    "open_bus",
    "partition_for",
    "rank_key",
]


def open_bus(url: str) -> Bus:
    """``memory`` (embedded bus) or ``kafka://HOST:PORT[,HOST:PORT...][?settings]`` (Kafka)."""
    if url in ("memory", "memory://"):
        from trainscope.transport.memory import MemoryBus

        return MemoryBus()
    if url.startswith("kafka://"):
        from trainscope.transport.kafka import KafkaBus

        # TLS/SASL settings come from the URL's query and TRAINSCOPE_KAFKA_* (kafka_security).
        return KafkaBus.from_url(url)
    raise ValueError(
        f"unknown bus URL {redact_url(url)!r}: expected 'memory' or 'kafka://HOST:PORT'"
    )
