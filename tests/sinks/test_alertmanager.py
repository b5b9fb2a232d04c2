"""Findings reach a real Alertmanager: one grouped notification per fault, resolved when it stops.

The pipeline runs in this process on the in-memory bus, fed by the simulated cluster; the
notifier posts over HTTP to ``prometheus-alertmanager`` on loopback, whose webhook receiver is a
local HTTP server. The fault "stops" by the same job carrying on from a healthy cluster, so
the detectors keep their history of the job.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from alertmanager_proc import Alertmanager, WebhookReceiver, free_port, require_alertmanager

from trainscope.cli.demo_job import publish_step
from trainscope.engine.bus_job import BusStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.sinks.alert_book import AlertBook
from trainscope.sinks.alertmanager import AlertmanagerNotifier
from trainscope.transport.memory import MemoryBus

START_NS = 1_767_225_600 * 10**9
WINDOW_S = 5.0


class Job:
    """One simulated job on an in-memory bus, read by a pipeline whose windows feed ``hook``."""

    def __init__(self, job_id: str, hook) -> None:
        self.job_id = job_id
        self.bus = MemoryBus()
        # A job that pauses between phases has its windows closed after 0.3 s of waiting.
        self.pipeline = BusStreamJob(self.bus, window_s=WINDOW_S, on_window=hook, job_idle_s=0.3,
                                 source_idle_s=0.2)
        self.end_ns = START_NS
        self.phases = 0

    def run(self, faults: list[str], steps: int = 40) -> None:
        """The next ``steps`` steps of the job, with ``faults`` (none: healthy)."""
        spec = ClusterSpec(job_id=self.job_id, dp=4, pp=2, tp=2, steps=steps,
                           seed=self.phases, window_s=WINDOW_S, start_ns=self.end_ns)
        cluster = SimulatedCluster(spec, parse_faults(faults))
        for output in cluster.run():
            publish_step(self.bus, cluster, output, output.step == 0 and self.phases == 0)
            for record in output.steps:
                self.end_ns = max(self.end_ns, record.start_ns + record.duration_ns)
            self.pipeline.poll_once(timeout_s=0.0)
        self.phases += 1

    def poll_until(self, condition, timeout_s: float = 20.0) -> None:
        """Keep polling (idle partitions stop holding windows) until ``condition()`` holds."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "the pipeline did not get there in time"
            self.pipeline.poll_once(timeout_s=0.02)


def notifier_for(url: str, **kwargs) -> AlertmanagerNotifier:
    book = AlertBook(threshold=0.5, dashboard_url="http://127.0.0.1:8321")
    return AlertmanagerNotifier(url, book, resend_s=1.0, max_backoff_s=0.5, **kwargs).start()


def _by_status(notifications: list[dict], status: str) -> list[dict]:
    return [n for n in notifications if n["status"] == status]


@pytest.mark.slow
def test_a_fault_fires_one_grouped_notification_and_resolves_when_it_stops(
    alertmanager: Alertmanager, webhook: WebhookReceiver
) -> None:
    notifier = notifier_for(alertmanager.url)
    job = Job("faulty-job", notifier.on_window)
    try:
        job.run(["slow-gpu:rank=5,factor=1.4"])
        job.poll_until(lambda: notifier.stats().alerts_fired > 0)
        firing = webhook.wait_for(lambda n: _by_status(n, "firing"), timeout_s=30)
        job.run([])  # the fault stops; the job goes on
        job.poll_until(lambda: notifier.stats().alerts_resolved > 0)
        job.pipeline.finish()
        resolved = webhook.wait_for(lambda n: _by_status(n, "resolved"), timeout_s=30)
        # Quiet for three more group intervals and resends: nothing else may arrive.
        notifications = webhook.wait_for(lambda n: False, timeout_s=3.0)
    finally:
        notifier.close()

    firing = _by_status(notifications, "firing")
    resolved = _by_status(notifications, "resolved")
    assert len(firing) == 1, notifications
    assert len(resolved) == 1, notifications
    assert notifications.index(firing[0]) < notifications.index(resolved[0])
    [alert] = firing[0]["alerts"]
    labels = alert["labels"]
    assert labels["alertname"] == "TrainscopeFinding"
    assert labels["job_id"] == "faulty-job"
    assert (labels["rank"], labels["category"]) == ("5", "gpu-compute")
    assert labels["function"].endswith("backward")
    assert labels["severity"] in ("warning", "critical")
    assert firing[0]["groupLabels"] == {"alertname": "TrainscopeFinding", "job_id": "faulty-job"}
    annotations = alert["annotations"]
    assert "rank 5" in annotations["message"]
    assert annotations["evidence"].startswith("{")
    assert annotations["dashboard"].startswith("http://127.0.0.1:8321/jobs/faulty-job?from_ns=")
    [gone] = resolved[0]["alerts"]
    assert gone["status"] == "resolved" and gone["labels"] == labels
    stats = notifier.stats()
    assert (stats.alerts_fired, stats.alerts_resolved, stats.dropped) == (1, 1, 0)
    assert stats.posts_failed == 0


@pytest.mark.slow
def test_a_healthy_job_notifies_nobody(
    alertmanager: Alertmanager, webhook: WebhookReceiver
) -> None:
    notifier = notifier_for(alertmanager.url)
    job = Job("healthy-job", notifier.on_window)
    windows: list[int] = []

    def count(view, findings) -> None:
        windows.append(view.window_start_ns)
        notifier.on_window(view, findings)

    job.pipeline.on_window = count
    try:
        job.run([], steps=60)
        job.pipeline.finish()
        # Longer than group_wait plus a resend: a notification would have come by now.
        notifications = webhook.wait_for(lambda n: False, timeout_s=3.0)
    finally:
        notifier.close()
    assert len(windows) >= 8  # the job was seen, window after window
    assert notifications == []
    assert alertmanager.alerts() == []
    assert notifier.stats().alerts_fired == 0


@pytest.mark.slow
def test_an_unreachable_alertmanager_costs_retries_not_the_pipeline(
    tmp_path: Path, webhook: WebhookReceiver
) -> None:
    """Alerts wait in the queue while Alertmanager is down and arrive once it is up."""
    require_alertmanager()
    port = free_port()
    notifier = notifier_for(f"http://127.0.0.1:{port}")
    job = Job("early-job", notifier.on_window)
    manager = None
    try:
        job.run(["dataloader-stall:rank=3,ms=300"])
        job.poll_until(lambda: notifier.stats().posts_failed >= 2)
        assert notifier.stats().alerts_fired >= 1
        assert notifier.stats().queued >= 1
        manager = Alertmanager(tmp_path, webhook.url, port=port)
        manager.wait_ready()
        notifications = webhook.wait_for(lambda n: _by_status(n, "firing"), timeout_s=30)
    finally:
        notifier.close()
        if manager is not None:
            manager.stop()
    [notification] = _by_status(notifications, "firing")
    assert {(a["labels"]["rank"], a["labels"]["category"])
            for a in notification["alerts"]} == {("3", "dataloader")}
    assert notifier.stats().dropped == 0
