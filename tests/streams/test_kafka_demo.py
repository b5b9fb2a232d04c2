"""The demo over the real Kafka-protocol broker gives the same diagnosis as on the memory bus."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ARGS = ["demo", "--no-store", "--ranks", "64", "--dp", "8", "--pp", "4", "--tp", "2",
        "--steps", "120", "--start-s", "1767225600",
        "--fault", "slow-gpu:rank=13,factor=1.4", "--json"]


def run(*extra: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "trainscope.cli", *ARGS, *extra],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr.lower(), done.stderr
    return json.loads(done.stdout)


@pytest.mark.kafka
@pytest.mark.slow
def test_kafka_demo_gives_the_same_top_finding(kafka_broker) -> None:
    over_kafka = run("--bus", kafka_broker.url)
    in_memory = run()
    top_kafka, top_memory = over_kafka["findings"][0], in_memory["findings"][0]
    assert (top_kafka["rank"], top_kafka["category"]) == (13, "gpu-compute")
    assert (top_kafka["rank"], top_kafka["category"], top_kafka["function"]) == (
        top_memory["rank"], top_memory["category"], top_memory["function"])
    # Every event crossed the broker and none arrived too late for its window.
    assert over_kafka["events"] == in_memory["events"]
    assert over_kafka["windows"] == in_memory["windows"]
