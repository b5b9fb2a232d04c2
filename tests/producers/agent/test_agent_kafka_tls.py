"""The host agent publishes over TLS: the bus URL carries the settings, the environment the
client key's password, which shows up nowhere in its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from kafka_tls import CLIENT_KEY_PASSWORD, tls_env

from trainscope.schemas.codec import decode_batch
from trainscope.transport.bus import METRICS_TOPIC, open_bus

pytestmark = pytest.mark.kafka


def test_agent_publishes_host_metrics_over_tls(tls_kafka_broker, monkeypatch) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.agent", "--bus", tls_kafka_broker.url(),
         "--interval", "0.1", "--window", "0.3", "--no-ebpf", "--job-id", "agent-tls",
         "--duration", "2", "-v"],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, **tls_env()},
    )
    assert done.returncode == 0, done.stderr
    assert CLIENT_KEY_PASSWORD not in done.stdout + done.stderr
    stats_line = next(ln for ln in done.stderr.splitlines() if "stopped; stats: " in ln)
    stats = json.loads(stats_line.split("stopped; stats: ", 1)[1])
    assert stats["records_published"] > 0 and stats["publish_errors"] == 0

    monkeypatch.setenv("TRAINSCOPE_KAFKA_SSL_KEY_PASSWORD", CLIENT_KEY_PASSWORD)
    bus = open_bus(tls_kafka_broker.url())
    try:
        consumer = bus.consumer([METRICS_TOPIC], "agent-tls-reader")
        records = 0
        deadline = time.monotonic() + 20
        while records < stats["records_published"] and time.monotonic() < deadline:
            for message in consumer.poll(timeout_s=0.5):
                records += sum(1 for r in decode_batch(message.value)
                               if getattr(r, "job_id", "") == "agent-tls")
        consumer.close()
    finally:
        bus.close()
    assert records == stats["records_published"]
