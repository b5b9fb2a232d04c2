"""Delivery of the stream job over the real broker, with ``trainscope pipeline`` as its own
process: crashes, restarts and re-sent batches leave the store exactly as an uninterrupted run
leaves it — plain ``count()`` and ``FINAL`` alike."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, dump_tables, publish, start_publisher

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
    """The pipeline consumes a live job and is SIGKILLed (or, now and then, SIGTERMed) at random
    moments (during start-up, mid-window, while catching up a backlog), restarted each time, and
    finally runs to the end.
    Then an uninterrupted run reads the same topic under another group into its own store.
    Both stores must hold the same rows in every table, plain and FINAL."""
    url = fresh_kafka_broker.url
    producer = start_publisher(url, *JOB, *PACE, out=tmp_path / "producer.out")
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    kills = []
    attempt = 0
    while producer.poll() is None or sum(k.startswith("KILL") for k in kills) < 5:
        p = PipelineProcess(url, tmp_path / "crash", "crashing", "--commit-interval-s", "0.3",
                            "--stats-every-s", "0.5",
                            logs=tmp_path / f"crash{attempt}", verbose=True)
        attempt += 1
        # Kill at a random moment after the member joined the group and polled once: before
        # its first commit, mid-window, while catching up the backlog the last kill left, or
        # live.
        deadline = time.monotonic() + 60
        # One run waits for its first commit, so that later runs start from a commit even on
        # a machine so loaded that every other kill lands before one.
        started = "bus_job: assigned partitions" if attempt != 3 else '"commits": 1,'
        while started not in p.err_text():
            assert p.process.poll() is None and time.monotonic() < deadline, p.err_text()
            time.sleep(0.05)
        delay = rng.uniform(0.1, 4.0)
        time.sleep(delay)
        assert p.process.poll() is None, p.err_text()
        # Mostly SIGKILL; every third stop on average is a SIGTERM (a rolling restart), whose
        # open windows wait in the checkpoint for the next run instead of closing early.
        if rng.random() < 1 / 3:
            assert p.terminate() == 0, p.err_text()
            kills.append(f"TERM@{delay:.2f}")
        else:
            p.kill()
            kills.append(f"KILL@{delay:.2f}")
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
    assert last.stats()["window"]["dropped"] == 0, kills  # nothing came late after a restart
    # Commits happened between the kills: the last run did not re-read the whole topic.
    assert last.stats()["decode"]["received"] < ref_stats["decode"]["received"], kills


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("outage_s", [3, 15])
def test_pipeline_survives_a_broker_outage(
    fresh_kafka_broker: TansuBroker, tmp_path: Path, outage_s: int
) -> None:
    """The broker goes away for ``outage_s`` while a job is being published and consumed, and
    comes back on the same port.

    The test broker keeps its log in memory only, so the broker that comes back is empty: what
    was on the topics and not yet read is gone, and so are the group's committed positions
    (with Kafka or Redpanda the log and the positions survive, and the at-least-once path of
    the crash test above applies). What can be required here, and is: the pipeline logs the
    outage without a traceback, keeps running, picks up the recreated topics, and every step
    that the producer published after the broker returned (and was told delivered) reaches the
    store, for every rank; SIGTERM still writes every window.
    """
    broker = fresh_kafka_broker
    url = broker.url
    ranks, steps = 16, 240
    # --close-idle-s above the outage: a job silent for that long is taken as finished.
    pipeline = PipelineProcess(url, tmp_path / "store", "outage", "--commit-interval-s", "0.5",
                               "--close-idle-s", "60", "--stop-timeout-s", "10", "--drain-on-stop",
                               logs=tmp_path / "pipeline")
    producer = start_publisher(url, "--dp", "4", "--pp", "2", "--tp", "2", "--steps",
                               str(steps), "--steps-per-s", str(STEPS_PER_S), "--flush-every", "3",
                               out=tmp_path / "producer.out")
    started = time.monotonic()
    time.sleep(12)  # the pipeline joined its group and is consuming live
    assert pipeline.process.poll() is None, pipeline.err_text()
    broker.stop()
    time.sleep(outage_s)
    broker.start()
    # The producer paces itself from its start, which is after Popen: by now it has published
    # at most this many steps, so every later step was published after the broker returned.
    returned_step = int((time.monotonic() - started) * STEPS_PER_S) + 1
    assert producer.wait(timeout=300) == 0, (tmp_path / "producer.out").read_text()
    sent = json.loads((tmp_path / "producer.out").read_text().strip().splitlines()[-1])
    first_checked = max(returned_step, sent["last_failed_step"]) + 1
    assert first_checked < steps - 20, (returned_step, sent)
    time.sleep(2)
    assert pipeline.process.poll() is None, pipeline.err_text()
    code = pipeline.terminate()

    err = pipeline.err_text()
    assert "Traceback" not in err, err
    # Logged, not flooded: the first line of each kind, then one a minute with a count.
    assert err.count("\n") < 60, err
    stats = pipeline.stats()
    assert stats["sink"]["dropped"] == 0
    if code != 0:
        # The restarted test broker refuses offset commits of a group it lost
        # (UnknownTopicOrPartition): the pipeline then says so and exits 1 — everything is
        # written, positions are not, and a restart re-reads and deduplicates.
        assert code == 1 and stats["commit_failures"] > 0, err
        assert "stopped before every window was written and committed" in err

    store_rows = dump_tables(tmp_path / "store", ("step_records",))["step_records"]
    seen = {(row[2], row[3]) for row in map(_literal, store_rows)}  # (rank, step)
    after = range(first_checked, steps)
    missing = [(r, s) for s in after for r in range(ranks) if (r, s) not in seen]
    assert not missing, f"{len(missing)} delivered steps missing, e.g. {missing[:5]}"


STEPS_PER_S = 6


def _literal(text: str) -> tuple:
    import ast

    return ast.literal_eval(text)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["checkpoint", "drain"])
def test_sigterm_commits_and_exits_0_and_nothing_is_lost(
    fresh_kafka_broker: TansuBroker, tmp_path: Path, mode: str
) -> None:
    """A job whose last windows are still open (its close-idle timeout is far away) when the
    pipeline is told to stop. SIGTERM commits and exits 0, bounded in time. By default the open
    windows go into the checkpoint: the first run wrote only closed windows, and a restart of
    the same group restores the open ones, has nothing left to read, and finishes them. With
    ``--drain-on-stop`` the first run writes them itself. Either way the store ends up with
    every step of every rank."""
    url = fresh_kafka_broker.url
    ranks, steps = 16, 60
    sent = publish(url, "--dp", "4", "--pp", "2", "--tp", "2", "--steps", str(steps))
    extra = ["--drain-on-stop"] if mode == "drain" else []
    pipeline = PipelineProcess(url, tmp_path / "store", "stopping", "--close-idle-s", "600",
                               *extra, logs=tmp_path / "first", verbose=True)
    deadline = time.monotonic() + 60
    while "newly assigned partitions" not in pipeline.err_text():
        assert pipeline.process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(4)  # the backlog is read; the job's last windows wait for more
    stopped = time.monotonic()
    assert pipeline.terminate(timeout_s=60) == 0, pipeline.err_text()
    assert time.monotonic() - stopped < 30  # bounded by --stop-timeout-s
    stats = pipeline.stats()
    assert stats["decode"]["received"] == sent["messages"]
    assert stats["sink"]["emitted"] == stats["sink"]["received"]
    assert stats["sink"]["emitted"] > 0 or mode == "checkpoint"  # partitions still held them
    assert stats["commits"] >= 1

    def stored_steps() -> set[tuple[int, int]]:
        rows = dump_tables(tmp_path / "store", ("step_records",))["step_records"]
        return {(row[2], row[3]) for row in map(_literal, rows)}

    every_step = {(r, s) for r in range(ranks) for s in range(steps)}
    if mode == "drain":
        assert stored_steps() == every_step
    else:
        assert stored_steps() < every_step  # the open windows wait in the checkpoint

    again = PipelineProcess(url, tmp_path / "store", "stopping", "--idle-exit-s", "2",
                            logs=tmp_path / "again", verbose=True)
    assert again.wait() == 0, again.err_text()
    assert again.stats()["decode"]["received"] == 0  # everything was committed
    restored = re.search(r"restored checkpoint of stopping: \d+ job\(s\), (\d+) open window",
                         again.err_text())
    assert restored is not None, again.err_text()
    assert (int(restored.group(1)) > 0) == (mode == "checkpoint")
    assert stored_steps() == every_step
