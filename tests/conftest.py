"""Shared fixtures: a real Kafka-protocol broker, also behind TLS, for tests marked ``kafka``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Helper modules next to this file (kafka_broker) are imported as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

from kafka_broker import TansuBroker
from kafka_tls import TlsBroker, stunnel_binary


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


@pytest.fixture(scope="session")
def tls_kafka_broker(tmp_path_factory) -> Iterator[TlsBroker]:
    """The broker behind a real stunnel TLS endpoint that demands a client certificate."""
    if stunnel_binary() is None:
        reason = "stunnel4 is not installed (infra/setup-test-host.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    with TlsBroker(tmp_path_factory.mktemp("kafka-tls")) as broker:
        yield broker
