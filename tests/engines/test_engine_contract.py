"""One recorded job, three engines, the same answer.

The job (simulated producers sending raw span events in the JSON wire format every engine reads,
a slow GPU on rank 5, every 7th message re-sent) is published once to the real broker and read
from the same topics by:

- the embedded engine: ``trainscope pipeline``;
- the Faust app, two workers: ``trainscope stream faust`` windowing the events itself;
- the Flink job (parallelism 2) windowing them into the summaries topic, with two Faust workers
  as the detection tier behind it (``trainscope stream faust --input summaries``), which is how
  ``infra/compose.yml`` deploys them.

Every engine must store the same function windows (count, total, min, max, bytes equal; the
quantiles of the sketch within its 1% accuracy; Flink computes the buckets in SQL) and the same
findings, the slow GPU among them.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from faust_procs import IDLE, FaustWorker
from flink_procs import (
    JOB,
    QUANTILES,
    by_key,
    detect,
    flink_python_or_skip,
    publish_json,
    read_store,
    run_flink,
    seal,
)

from trainscope.schemas import sketch
from trainscope.schemas.topics import EVENTS_TOPIC


def faust_workers(url: str, tmp_path: Path, app_id: str, *args: str) -> dict:
    """Two workers of one app until both exit; their stores read together."""
    workers = [FaustWorker(url, tmp_path / f"{app_id}-{i}", app_id, tmp_path / f"{app_id}-{i}",
                           (*IDLE, *args)) for i in range(2)]
    stats = [w.wait() for w in workers]
    assert sum(s["window"]["dropped"] for s in stats) == 0, stats  # late records
    assert sum(s["decode"]["rejected"] for s in stats) == 0, stats
    merged: dict = {"summaries": [], "findings": [], "steps": 0}
    for i in range(2):
        store = read_store(tmp_path / f"{app_id}-{i}")
        merged["summaries"] += store["summaries"]
        merged["findings"] += store["findings"]
        merged["steps"] += store["steps"]
    return merged


def findings(store: dict) -> Counter:
    return Counter((job, rank, category, function)
                   for job, rank, category, function, _ in store["findings"])


def assert_same_windows(reference: dict, other: dict, engine: str) -> None:
    mine, theirs = by_key(reference["summaries"]), by_key(other["summaries"])
    assert mine.keys() == theirs.keys(), engine
    for key, (count, total, low, high, moved, keys, counts) in mine.items():
        o_count, o_total, o_low, o_high, o_moved, o_keys, o_counts = theirs[key]
        assert (count, total, low, high, moved) == (o_count, o_total, o_low, o_high, o_moved), (
            engine, key)
        assert sum(o_counts) == count, (engine, key)
        for q in QUANTILES:
            expected = sketch.quantile(keys, counts, q)
            got = sketch.quantile(o_keys, o_counts, q)
            assert abs(got - expected) <= sketch.RELATIVE_ACCURACY * expected, (engine, key, q)
    assert other["steps"] == reference["steps"], engine
    assert findings(other) == findings(reference), engine


@pytest.mark.kafka
@pytest.mark.slow
def test_embedded_faust_and_flink_store_the_same_windows_and_findings(
    fresh_kafka_broker, tmp_path: Path
) -> None:
    flink_python_or_skip()
    url = fresh_kafka_broker.url
    sent = publish_json(url, *JOB)
    seal(fresh_kafka_broker.bootstrap_servers, EVENTS_TOPIC)

    stats = detect(url, tmp_path / "embedded", "embedded", logs=tmp_path / "embedded")
    assert stats["duplicate_batches"] == sent["resent"] > 0
    embedded = read_store(tmp_path / "embedded")
    assert sum(row[6] for row in embedded["summaries"]) == sent["events"]
    assert any(rank == 5 and category == "gpu-compute"
               for _, rank, category, _ in findings(embedded)), embedded["findings"]

    faust = faust_workers(url, tmp_path, "contract-events")
    assert_same_windows(embedded, faust, "faust")

    flink = run_flink(url, "--parallelism", "2")
    assert flink.returncode == 0, flink.stderr
    flink_then_faust = faust_workers(url, tmp_path, "contract-summaries", "--input", "summaries")
    assert_same_windows(embedded, flink_then_faust, "flink + faust --input summaries")
