"""``trainscope pipeline --metrics-port --alertmanager`` as its own process, over the real broker.

Its ``/metrics`` is scraped while a simulated faulty job streams through it: the counters move,
and the fault reaches the real Alertmanager as a notification naming the rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from alertmanager_proc import Alertmanager, WebhookReceiver, free_port
from kafka_broker import TansuBroker
from metrics_scrape import scrape_until, value
from pipeline_procs import PipelineProcess, publish


@pytest.mark.kafka
@pytest.mark.slow
def test_metrics_move_and_the_fault_reaches_alertmanager(
    fresh_kafka_broker: TansuBroker, alertmanager: Alertmanager, webhook: WebhookReceiver,
    tmp_path: Path,
) -> None:
    port = free_port()
    pipeline = PipelineProcess(
        fresh_kafka_broker.url, tmp_path / "store", "health", "--window-s", "5",
        "--close-idle-s", "1", "--source-idle-s", "1", "--commit-interval-s", "0.5",
        "--metrics-port", str(port), "--alertmanager", alertmanager.url,
        "--alert-resend-s", "1", "--dashboard-url", "http://127.0.0.1:8321",
        logs=tmp_path / "pipeline",
    )
    try:
        before = scrape_until(port, lambda m: True)
        publish(fresh_kafka_broker.url, "--job-id", "sick", "--dp", "4", "--pp", "2", "--tp",
                "2", "--steps", "40", "--window-s", "5", "--fault", "slow-gpu:rank=6,factor=1.4")
        after = scrape_until(
            port, lambda m: value(m, "trainscope_alertmanager_alerts_sent_total") > 0
            and value(m, "trainscope_pipeline_commits_total") > 0
            and value(m, "trainscope_auto_profile_requested_total") > 0
        )
        notifications = webhook.wait_for(lambda n: len(n) > 0, timeout_s=30)
    finally:
        code = pipeline.terminate()
    assert code == 0, pipeline.err_text()

    for name in ("messages_received", "records_received", "windows_closed", "findings",
                 "sink_windows_written", "commits"):
        metric = f"trainscope_pipeline_{name}_total"
        assert value(before, metric) == 0, metric
        assert value(after, metric) > 0, metric
    assert value(after, "trainscope_pipeline_messages_rejected_total") == 0
    assert value(after, "trainscope_pipeline_detector_seconds_total", detector="peer-diff") > 0
    assert value(after, "trainscope_alertmanager_posts_failed_total") == 0
    assert value(after, "trainscope_alertmanager_firing") >= 1
    # The alert asked the suspect and one peer for a profile (the simulated job never answers).
    assert value(before, "trainscope_auto_profile_requested_total") == 0
    assert value(after, "trainscope_auto_profile_requested_total") == 2

    [notification] = notifications
    assert notification["status"] == "firing"
    assert {(a["labels"]["rank"], a["labels"]["category"])
            for a in notification["alerts"]} == {("6", "gpu-compute")}
    # The final stats line carries the notifier's counts too.
    assert pipeline.stats()["alertmanager"]["alerts_fired"] == 1


def test_a_bad_alertmanager_url_is_one_error_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", "pipeline", "--bus", "kafka://127.0.0.1:1",
         "--store", str(tmp_path / "store"), "--alertmanager", "alertmanager:9093"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 1
    assert done.stderr == ("Error: --alertmanager: Alertmanager URL must start with http:// or "
                           "https://, got 'alertmanager:9093'\n")
