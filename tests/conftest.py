"""Shared fixtures: a real Kafka-protocol broker for the tests marked ``kafka``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Helper modules next to this file (kafka_broker) are imported as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

from kafka_broker import TansuBroker


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[TansuBroker]:
    """One broker for the whole session; tests isolate themselves with unique topic names."""
    with TansuBroker() as broker:
        yield broker


@pytest.fixture
def fresh_kafka_broker() -> Iterator[TansuBroker]:
    """A broker of the test's own, which the test may ``stop()`` and ``start()`` again."""
    with TansuBroker() as broker:
        yield broker
