"""The demo over the real Kafka-protocol broker gives the same diagnosis as on the memory bus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_procs import PipelineProcess, diagnose_store, start_publisher

ARGS = ["demo", "--no-store", "--ranks", "64", "--dp", "8", "--pp", "4", "--tp", "2",
        "--steps", "120", "--start-s", "1767225600",
        "--fault", "slow-gpu:rank=13,factor=1.4", "--json"]


def run(*extra: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", *ARGS, *extra],
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
    assert over_kafka["summaries"] == in_memory["summaries"] > 0
    assert over_kafka["windows"] == in_memory["windows"]


@pytest.mark.kafka
@pytest.mark.slow
def test_the_demo_on_a_shared_broker_diagnoses_its_own_job_only(
    fresh_kafka_broker, tmp_path: Path
) -> None:
    """A broker that already carries two other jobs over the same hours, one of them with a
    fault of its own: the demo reads past them and reports exactly what it reports alone."""
    url = fresh_kafka_broker.url
    common = ["--dp", "8", "--pp", "4", "--tp", "2", "--steps", "120", "--start-s", "1767225600"]
    others = [
        start_publisher(url, *common, "--job-id", "other-healthy", "--seed", "3",
                        out=tmp_path / "healthy.out"),
        start_publisher(url, *common, "--job-id", "other-faulty", "--seed", "4",
                        "--fault", "slow-gpu:rank=5,factor=2.0", out=tmp_path / "faulty.out"),
    ]
    for index, other in enumerate(others):
        assert other.wait(timeout=300) == 0, (tmp_path / ("healthy.out", "faulty.out")[index])
    shared = run("--bus", url)
    alone = run()
    assert [(f["rank"], f["category"]) for f in shared["findings"]] == [
        (f["rank"], f["category"]) for f in alone["findings"]]
    assert (shared["events"], shared["summaries"], shared["windows"]) == (
        alone["events"], alone["summaries"], alone["windows"])
    table = subprocess.run([sys.executable, "-m", "trainscope.cli.main",
                            *[a for a in ARGS if a != "--json"], "--bus", url],
                           capture_output=True, text=True, timeout=300, check=True).stdout
    assert "other-" not in table, table


@pytest.mark.kafka
@pytest.mark.slow
def test_pipeline_process_over_kafka_drops_nothing_and_diagnoses_like_memory(
    fresh_kafka_broker, tmp_path: Path
) -> None:
    """Production shape: ``trainscope pipeline`` in its own process, two 64-rank jobs published
    live by two producer processes onto the same partitioned topics. The partitions are read
    unevenly; the watermarks must wait for the slow ones: no late event, no alert on the
    healthy job, and the faulty job diagnosed as on the memory bus."""
    url = fresh_kafka_broker.url
    common = ["--dp", "8", "--pp", "4", "--tp", "2", "--steps", "120",
              "--start-s", "1767225600", "--steps-per-s", "12"]
    pipeline = PipelineProcess(url, tmp_path / "store", "live", "--close-idle-s", "3",
                               "--idle-exit-s", "5", logs=tmp_path / "pipeline")
    healthy = start_publisher(url, *common, "--job-id", "healthy", "--seed", "1",
                              out=tmp_path / "healthy.out")
    faulty = start_publisher(url, *common, "--job-id", "demo-job", "--seed", "0",
                             "--fault", "slow-gpu:rank=13,factor=1.4", out=tmp_path / "faulty.out")
    assert healthy.wait(timeout=300) == 0, (tmp_path / "healthy.out").read_text()
    assert faulty.wait(timeout=300) == 0, (tmp_path / "faulty.out").read_text()
    assert pipeline.wait() == 0, pipeline.err_text()
    assert "Traceback" not in pipeline.err_text()
    stats = pipeline.stats()
    sent = [json.loads(p.read_text().strip().splitlines()[-1])
            for p in (tmp_path / "healthy.out", tmp_path / "faulty.out")]
    assert stats["decode"]["received"] == sum(s["messages"] for s in sent)
    assert stats["window"]["dropped"] == 0  # late events
    assert stats["window"]["rejected"] == 0

    assert "] healthy:" not in pipeline.out_text()  # no ALERT line for the healthy job
    assert diagnose_store(tmp_path / "store", "healthy")["suspects"] == []
    over_kafka = diagnose_store(tmp_path / "store", "demo-job")["suspects"]
    in_memory = run()["findings"]
    assert over_kafka and in_memory
    top_kafka, top_memory = over_kafka[0], in_memory[0]
    assert (top_kafka["rank"], top_kafka["category"]) == (
        top_memory["rank"], top_memory["category"]) == (13, "gpu-compute")
    # The suspect's function is the one of its highest-scoring finding; one pipeline's
    # detectors still share their history across jobs (the mixture model and the step-time
    # baseline see both jobs' windows), so it is compared on the peer-diff findings alone.
    peer = diagnose_store(tmp_path / "store", "demo-job", detector="peer-diff")["suspects"]
    assert (peer[0]["rank"], peer[0]["category"], peer[0]["function"]) == (
        13, "gpu-compute", top_memory["function"])
