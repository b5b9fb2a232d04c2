"""The PyFlink windowing tier against the embedded engine, over the real broker and real Flink.

One recorded job (simulated producers sending raw spans in the JSON wire format, with a slow
GPU) is read twice from the same events topic: by ``trainscope pipeline`` (the embedded engine
windows and detects), and by ``trainscope stream flink`` (Flink SQL windows it into the
summaries topic) followed by ``trainscope pipeline --input summaries`` (the detection tier).
Both stores must hold the same per-function windows and the same findings.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from flink_procs import (
    JOB,
    QUANTILES,
    by_key,
    detect,
    flink_python_or_skip,
    publish_json,
    publish_raw,
    read_store,
    read_topic,
    run_flink,
    seal,
)

from trainscope.schemas import sketch
from trainscope.schemas.codec import decode_envelope, encode_batch
from trainscope.schemas.records import FunctionSummary, MetricSample
from trainscope.schemas.topics import DEAD_LETTER_TOPIC, EVENTS_TOPIC, SUMMARIES_TOPIC


@pytest.fixture(scope="module")
def flink_python() -> Path:
    return flink_python_or_skip()


@pytest.mark.kafka
@pytest.mark.slow
def test_flink_tier_windows_and_detects_like_the_embedded_engine(
    flink_python, fresh_kafka_broker, tmp_path: Path
) -> None:
    url = fresh_kafka_broker.url
    sent = publish_json(url, *JOB)
    seal(fresh_kafka_broker.bootstrap_servers, EVENTS_TOPIC)

    embedded = detect(url, tmp_path / "embedded", "embedded", logs=tmp_path / "embedded")
    flink = run_flink(url, "--parallelism", "2")
    assert flink.returncode == 0, flink.stderr
    summary = json.loads(flink.stdout.strip().splitlines()[-1])
    assert summary["bounded"] and summary["parallelism"] == 2
    tiered = detect(url, tmp_path / "tiered", "tiered", "--input", "summaries",
                    logs=tmp_path / "tiered")

    assert embedded["window"]["dropped"] == tiered["window"]["dropped"] == 0  # late
    assert embedded["decode"]["rejected"] == tiered["decode"]["rejected"] == 0
    assert embedded["duplicate_batches"] == sent["resent"] > 0
    ours, theirs = read_store(tmp_path / "embedded"), read_store(tmp_path / "tiered")
    assert sum(r[6] for r in ours["summaries"]) == sent["events"]
    assert ours["steps"] == theirs["steps"] == 16 * 60

    mine, flinks = by_key(ours["summaries"]), by_key(theirs["summaries"])
    assert mine.keys() == flinks.keys()
    for key, (count, total, low, high, moved, keys, counts) in mine.items():
        f_count, f_total, f_low, f_high, f_moved, f_keys, f_counts = flinks[key]
        assert (count, total, low, high, moved) == (f_count, f_total, f_low, f_high, f_moved), key
        assert sum(f_counts) == count
        for q in QUANTILES:
            expected = sketch.quantile(keys, counts, q)
            got = sketch.quantile(f_keys, f_counts, q)
            assert abs(got - expected) <= sketch.RELATIVE_ACCURACY * expected, (key, q)

    def findings(store: dict) -> Counter:
        return Counter((job, rank, category, function)
                       for job, rank, category, function, _ in store["findings"])

    assert findings(ours) == findings(theirs)
    assert any(rank == 5 and category == "gpu-compute"
               for _, rank, category, _ in findings(theirs)), theirs["findings"]


@pytest.mark.kafka
@pytest.mark.slow
def test_a_message_flink_cannot_read_is_dead_lettered_and_the_job_goes_on(
    flink_python, fresh_kafka_broker, tmp_path: Path
) -> None:
    """Flink's JSON format skips what it cannot parse (``json.ignore-parse-errors``); the job
    reads the topic raw as well and sets those messages aside on the dead-letter topic, keyed by
    where they were and why, as the embedded pipeline does."""
    url, servers = fresh_kafka_broker.url, fresh_kafka_broker.bootstrap_servers
    short = ["--job-id", "ok-job", "--dp", "2", "--pp", "1", "--tp", "1", "--steps", "20",
             "--start-s", "1767225600", "--spans"]
    sent = publish_json(url, *short)
    msgpack = encode_batch([MetricSample(job_id="ok-job", ts_ns=1, name="x", value=1.0)],
                           wire="msgpack")
    bad = [b"\x00\xffnot json at all", msgpack, b'{"type": "summary", "job_id": 3}', b"[1, 2]"]
    # A batch whose JSON parses, with events Flink reads as NULLs or the engine would reject,
    # and one good event (after the job's last window: not late).
    at_ns = (1767225600 + 25) * 10**9
    events = [["x", 0, 0, at_ns, 5, 0, 0], [0, 0, 0, at_ns, 5, 0], [0, 7, 0, at_ns, 5, 0, 0],
              [0, 0, 0, at_ns, -1, 0, 0], [0, 0, 0, at_ns, 5, 0, 0]]
    mixed = json.dumps({"type": "batch", "t_ms": at_ns // 10**6, "spans": [
        {"job_id": "ok-job", "layers": ["torch_op"], "names": ["mm"], "events": events}],
        "steps": [{"job_id": "ok-job", "rank": 0, "step": "ten", "start_ns": at_ns,
                   "duration_ns": 5}]})
    # Events of the job's first window, sent after the rest: late if Flink's watermark has
    # passed that window when it reads them (it depends on the order it reads partitions in).
    early_ns = (1767225600 + 1) * 10**9
    late = json.dumps({"type": "batch", "t_ms": early_ns // 10**6, "spans": [
        {"job_id": "ok-job", "layers": ["torch_op"], "names": ["mm"],
         "events": [[1, 0, 0, early_ns, 5, 0, 0], [1, 0, 0, early_ns, 6, 0, 0]]}]})
    publish_raw(servers, EVENTS_TOPIC, [*bad, mixed.encode(), late.encode()])
    seal(servers, EVENTS_TOPIC)

    flink = run_flink(url)
    assert flink.returncode == 0, flink.stderr

    letters = read_topic(url, DEAD_LETTER_TOPIC)
    whole = [m for m in letters if b"span event" not in m.key and b"step record" not in m.key]
    assert sorted(m.value for m in whole) == sorted(bad)
    reasons = [m.key.decode() for m in letters]
    assert all(r.startswith(f"{EVENTS_TOPIC}[") and "flink job: " in r for r in reasons), reasons
    assert sum("TRAINSCOPE_WIRE=json" in r for r in reasons) == 3  # not JSON objects
    assert sum('no "type": "batch"' in r for r in reasons) == 1
    spoiled = sorted(r.rsplit(": ", 1)[1] for r in reasons if "span event" in r
                     and "late" not in r)
    assert spoiled == ["a field is not an integer", "fn is not one of its batch's functions",
                       "negative duration_ns", "not an array of 7 integers"], reasons
    assert sum("step record of job ok-job: job_id, rank, step" in r for r in reasons) == 1

    # The good messages around them were windowed in full.
    records = [r for m in read_topic(url, SUMMARIES_TOPIC)
               for r in decode_envelope(m.value).records]
    counted = sum(r.count for r in records if isinstance(r, FunctionSummary))
    # Every good event is in a window or, late, in the dead letters: none is lost.
    late_letters = sum("late: its window had closed" in r for r in reasons)
    assert late_letters in (0, 2)
    assert counted + late_letters == sent["events"] + 1 + 2


def summarised(url: str, job_id: str) -> int:
    """Events counted in the summaries on the summaries topic for ``job_id``."""
    return sum(r.count for m in read_topic(url, SUMMARIES_TOPIC, idle_s=1.0)
               for r in decode_envelope(m.value).records
               if isinstance(r, FunctionSummary) and r.job_id == job_id)


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}" + (
            f"; the job's log ends:\n{log.read_text()[-6000:]}" if log is not None else "")
        time.sleep(1.0)


@pytest.mark.kafka
@pytest.mark.slow
def test_an_unbounded_job_stopped_and_started_again_loses_and_doubles_nothing(
    flink_python, fresh_kafka_broker, tmp_path: Path
) -> None:
    """With --checkpoint-dir, a stopped job resumes from its newest checkpoint: the windows it
    had open and the offsets they cover, so every event is summarised exactly once."""
    url, servers = fresh_kafka_broker.url, fresh_kafka_broker.bootstrap_servers
    checkpoints = tmp_path / "checkpoints"
    job = ["--job-id", "again", "--dp", "2", "--pp", "2", "--tp", "2", "--steps", "30", "--spans"]
    first = publish_json(url, *job, "--start-s", "1767225600")

    def start(source_idle_s: float) -> subprocess.Popen[bytes]:
        with (tmp_path / "flink.log").open("ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "trainscope.cli.main", "stream", "flink", "--bus", url,
                 "--checkpoint-dir", str(checkpoints), "--checkpoint-interval-s", "1",
                 "--source-idle-s", str(source_idle_s)], stdout=log, stderr=log)

    def newest_checkpoint_s() -> float:
        done = [p.stat().st_mtime for p in checkpoints.glob("*/chk-*/_metadata")]
        return max(done, default=0.0)

    flink = start(source_idle_s=1)
    try:
        # The first window fires once the events of the second are read; the one after a
        # checkpoint that follows it, the job stops with that window open.
        wait_for(lambda: summarised(url, "again") > 0, 120, "the first window")
        fired_s = time.time()
        wait_for(lambda: newest_checkpoint_s() > fired_s + 0.5, 60, "a checkpoint after it")
    finally:
        flink.send_signal(signal.SIGTERM)
        assert flink.wait(timeout=60) == 0, (tmp_path / "flink.log").read_text()
    written = summarised(url, "again")
    assert 0 < written < first["events"]

    second = publish_json(url, *job, "--start-s", "1767225631", "--seed", "1")
    # Events far later, on one partition (one key), move the watermark past the job's windows
    # once the other partitions have been idle for --source-idle-s. The restored job gets 20 s:
    # with 1 s, a JVM restoring its state on a loaded machine read the far events before it
    # had fetched from the other partitions for a second, called those idle, and the second
    # run's events on them came late (the whole second run, in a loaded CI run).
    far_ns = (1767225600 + 300) * 10**9
    publish_raw(servers, EVENTS_TOPIC, [json.dumps({
        "type": "batch", "t_ms": far_ns // 10**6, "spans": [
            {"job_id": "flush", "layers": ["a"], "names": ["b"],
             "events": [[0, 0, 0, far_ns, 5, 0, 0]]}]}).encode()] * 8)
    flink = start(source_idle_s=20)
    total = first["events"] + second["events"]
    seen: list[tuple[float, int]] = []  # (seconds since the restart, events summarised)
    restarted = time.monotonic()

    def all_summarised() -> bool:
        seen.append((round(time.monotonic() - restarted), summarised(url, "again")))
        return seen[-1][1] >= total

    try:
        # A JVM restoring its state on a loaded two-core machine: minutes, not seconds.
        try:
            wait_for(all_summarised, 300, f"every window ({total} events)",
                     tmp_path / "flink.log")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nsummarised by then (s, events): {seen[::10]}, "
                                 f"{seen[-1]}") from None
        print(f"\nall {total} events summarised {seen[-1][0]} s after the restart")
    finally:
        flink.send_signal(signal.SIGTERM)
        assert flink.wait(timeout=60) == 0
    assert f'"resumed_from": "{checkpoints}/' in (tmp_path / "flink.log").read_text()
    assert summarised(url, "again") == total
