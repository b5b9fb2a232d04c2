"""Delivery of the stream job over the real broker, with ``trainscope pipeline`` as its own
process: crashes, restarts and re-sent batches leave the store exactly as an uninterrupted run
leaves it — plain ``count()`` and ``FINAL`` alike."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, dump_tables, start_publisher

# A 32-rank job of 240 steps (~24 windows of 15 s), published live over ~30 s; every 5th
# message is published twice, as a producer re-sending after a timeout does.
JOB = ["--dp", "8", "--pp", "2", "--tp", "2", "--steps", "240", "--seed", "5",
       "--resend-every", "5", "--fault", "slow-gpu:rank=9,factor=1.5"]
PACE = ["--steps-per-s", "8"]
# Commit often so that kills land between commits, mid-window and mid-backlog.
FAST = ["--commit-interval-s", "0.3", "--close-idle-s", "3", "--idle-exit-s", "4"]


def run_to_end(url: str, store: Path, group: str, logs: Path) -> PipelineProcess:
    p = PipelineProcess(url, store, group, *FAST, logs=logs)
    assert p.wait() == 0, p.err_text()
    assert "Traceback" not in p.err_text()
    return p


@pytest.mark.kafka
@pytest.mark.slow
def test_sigkill_at_random_points_leaves_the_same_tables(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """The pipeline consumes a live job and is SIGKILLed at random moments (during start-up,
    mid-window, while catching up a backlog), restarted each time, and finally runs to the end.
    Then an uninterrupted run reads the same topic under another group into its own store.
    Both stores must hold the same rows in every table, plain and FINAL."""
    url = fresh_kafka_broker.url
    producer = start_publisher(url, *JOB, *PACE, out=tmp_path / "producer.out")
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    kills = []
    attempt = 0
    while producer.poll() is None or len(kills) < 5:
        p = PipelineProcess(url, tmp_path / "crash", "crashing", "--commit-interval-s", "0.3",
                            logs=tmp_path / f"crash{attempt}", verbose=True)
        attempt += 1
        # Kill at a random moment after the member joined the group: before its first
        # commit, mid-window, while catching up the backlog the last kill left, or live.
        deadline = time.monotonic() + 60
        while "newly assigned partitions" not in p.err_text():
            assert p.process.poll() is None and time.monotonic() < deadline, p.err_text()
            time.sleep(0.05)
        delay = rng.uniform(0.1, 4.0)
        time.sleep(delay)
        assert p.process.poll() is None, p.err_text()
        p.kill()
        kills.append(round(delay, 2))
    assert producer.wait() == 0
    sent = json.loads((tmp_path / "producer.out").read_text().strip().splitlines()[-1])
    assert sent["resent"] > 0 and sent["bus"]["failed"] == 0
    last = run_to_end(url, tmp_path / "crash", "crashing", tmp_path / "last")

    reference = run_to_end(url, tmp_path / "ref", "reference", tmp_path / "ref")
    ref_stats = reference.stats()
    assert ref_stats["decode"]["received"] == sent["messages"] + sent["resent"]
    assert ref_stats["duplicate_batches"] == sent["resent"]
    assert ref_stats["window"]["dropped"] == 0  # no late events

    expected = dump_tables(tmp_path / "ref")
    got = dump_tables(tmp_path / "crash")
    assert expected["function_summaries"], "the reference run wrote nothing"
    for table, rows in expected.items():
        assert got[table] == rows, f"{table} differs after kills at {kills} s (seed {seed})"
    # Commits happened between the kills: the last run did not re-read the whole topic.
    assert last.stats()["decode"]["received"] < ref_stats["decode"]["received"], kills
