"""One ``trainscope pipeline`` per consumer group: a second member is refused, the first one
carries on as if nothing happened.

Over the real broker, pipelines as processes of their own. A second pipeline started with the
same ``--group`` (the first thing a user tries to scale out) used to take half of the
partitions: false ``hang`` findings, split findings, step records written twice and a false
"topic was recreated" warning. Now every partition goes to one member
(trainscope.transport.kafka_group); the other exits 1 with one line naming the group and the
way to scale out, having read, written and committed nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, dump_tables, start_publisher

RANKS = 8
STEPS = 200
JOB = ["--dp", "4", "--pp", "2", "--tp", "1", "--steps", str(STEPS), "--seed", "3",
       "--fault", "slow-gpu:rank=5,factor=1.6"]
FAST = ["--commit-interval-s", "0.3", "--close-idle-s", "3", "--idle-exit-s", "4",
        "--no-auto-profile"]


def wait_for(process: PipelineProcess, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in process.err_text():
        assert process.process.poll() is None, process.err_text()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{process.err_text()}"
        time.sleep(0.05)


def assert_refused(process: PipelineProcess, group: str) -> None:
    """Exit 1 with one line that names the group and the way to scale out, having read and
    committed nothing."""
    assert process.wait(timeout_s=60) == 1, process.err_text()
    err = process.err_text()
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, err
    assert f"consumer group {group!r}" in lines[0] and "held by another member" in lines[0]
    assert "trainscope stream faust" in lines[0] and "--group" in lines[0], lines[0]
    stats = process.stats()
    assert stats["decode"]["received"] == 0 and stats["commits"] == 0, stats


def step_keys(rows: list[str]) -> list[str]:
    """(version, job_id, rank, step) of each step record row, as text: its first columns."""
    return [", ".join(row.split(", ")[:4]) for row in rows]


@pytest.mark.kafka
def test_second_members_are_refused_and_the_first_runs_unaffected(
    fresh_kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    """Two pipelines of one group start at the same moment over a live job: exactly one is
    refused. A third joins mid-run, once the survivor has read, written and committed: it is
    refused too. The survivor's store then holds every step record exactly once (plain and
    FINAL), no hang, and every table equals that of a pipeline alone in its group."""
    url = fresh_kafka_broker.url
    producer = start_publisher(url, *JOB, "--steps-per-s", "10", out=tmp_path / "producer.out")
    members = [PipelineProcess(url, tmp_path / name, "shared", *FAST, "--stats-every-s", "0.5",
                               logs=tmp_path / name, verbose=True) for name in ("a", "b")]
    late = None
    try:
        # Whichever its leader picked (the one that started first) holds the group.
        deadline = time.monotonic() + 60
        while all(m.process.poll() is None for m in members):
            assert time.monotonic() < deadline, [m.err_text() for m in members]
            time.sleep(0.05)
        refused = next(m for m in members if m.process.poll() is not None)
        survivor = next(m for m in members if m is not refused)
        assert_refused(refused, "shared")
        wait_for(survivor, '"commits": 1,')  # it has read, written and committed
        late = PipelineProcess(url, tmp_path / "late", "shared", *FAST, logs=tmp_path / "late")
        assert_refused(late, "shared")
        assert producer.poll() is None, "the job ended before the third member was refused"
        assert producer.wait(timeout=120) == 0
        assert survivor.wait() == 0, survivor.err_text()
    finally:
        for p in (*members, late):
            if p is not None and p.process.poll() is None:
                p.kill()
        if producer.poll() is None:
            producer.kill()
    err = survivor.err_text()
    assert "Traceback" not in err and "recreated" not in err, err
    assert survivor.stats()["window"]["dropped"] == 0

    reference = PipelineProcess(url, tmp_path / "reference", "reference", *FAST,
                                logs=tmp_path / "reference")
    assert reference.wait() == 0, reference.err_text()
    got = dump_tables(survivor.logs)  # the store directory: logs are beside it (.out, .err)
    for final in ("", " FINAL"):
        keys = step_keys(got["step_records" + final])
        assert len(keys) == len(set(keys)) == RANKS * STEPS, final
        assert not [row for row in got["findings" + final] if "'hang'" in row]
    assert got["findings"], "the slow rank was not diagnosed"
    expected = dump_tables(tmp_path / "reference")
    for table, rows in expected.items():
        assert got[table] == rows, table
