"""The stream job's health at ``/metrics``, in Prometheus text format.

A custom ``prometheus_client`` collector over the pipeline's own counters
(:class:`~trainscope.engine.core.PipelineStats`, the detector runner's time per detector and
the Alertmanager notifier's counts): each scrape reads them as they are, so there is one set of
counters, not a second copy kept in step. A scrape runs on the HTTP server's thread while the
pipeline works; it only reads integers and copies small dicts.

Not exported: consumer lag. The bus consumer does not report the partitions' end offsets (and
the test broker reports them wrongly, see DESIGN.md), so it has no honest figure to give.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from trainscope.engine.core import PipelineStats, StreamCore

log = logging.getLogger(__name__)

PREFIX = "trainscope_pipeline_"


class NotifierStats(Protocol):
    """The counts an alert notifier keeps (:class:`trainscope.sinks.alertmanager.NotifierStats`
    is one); a protocol so that the engine's /metrics does not depend on the sinks."""

    alerts_fired: int
    alerts_resolved: int
    alerts_sent: int
    posts: int
    posts_failed: int
    dropped: int
    queued: int
    firing: int


class PipelineCollector:
    """``pipeline``: the running stream job; ``notifier_stats``: the Alertmanager notifier's
    counts, if one is configured."""

    def __init__(
        self,
        pipeline: StreamCore,
        notifier_stats: Callable[[], NotifierStats] | None = None,
        auto_profile_counts: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.notifier_stats = notifier_stats
        self.auto_profile_counts = auto_profile_counts

    def collect(self) -> Iterator[Metric]:
        stats = self.pipeline.stats()
        for name, (doc, value) in _counters(stats).items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        errors = CounterMetricFamily(PREFIX + "detector_errors", "detect() calls that raised.",
                                     labels=["detector"])
        for detector, count in sorted(dict(stats.detector_errors).items()):
            errors.add_metric([detector], count)
        yield errors
        over = CounterMetricFamily(PREFIX + "detector_over_budget",
                                   "detect() calls stopped over --detector-budget-s; the window "
                                   "went without that detector.", labels=["detector"])
        for detector, count in sorted(dict(stats.detector_over_budget).items()):
            over.add_metric([detector], count)
        yield over
        # Divided by windows_closed, the mean detector time per window.
        seconds = CounterMetricFamily(PREFIX + "detector_seconds",
                                      "Seconds spent in each detector's detect(), all windows.",
                                      labels=["detector"])
        for detector, spent_s in sorted(_copy(self.pipeline.runner.detect_seconds).items()):
            seconds.add_metric([detector], spent_s)
        yield seconds
        try:
            open_windows = self.pipeline.engine.open_windows()
        except RuntimeError:  # the pipeline changed its jobs mid-count; the next scrape has it
            pass
        else:
            yield GaugeMetricFamily(PREFIX + "open_windows", "Windows open now.",
                                    value=open_windows)
        yield GaugeMetricFamily(PREFIX + "stamps_kept",
                                "Producer stamps kept to drop re-sent batches (those of the "
                                "open windows' batches).", value=stats.stamps_kept)
        if self.notifier_stats is not None:
            yield from _notifier_metrics(self.notifier_stats())
        if self.auto_profile_counts is not None:
            for name, value in sorted(self.auto_profile_counts().items()):
                yield CounterMetricFamily(
                    "trainscope_auto_profile_" + name,
                    f"Automatic profiles of suspects and peers: {name.replace('_', ' ')}.",
                    value=value,
                )


def _counters(stats: PipelineStats) -> dict[str, tuple[str, int]]:
    """The pipeline's counters by name: what each counts, and its value now."""
    return {
        "messages_received": ("Bus messages read.", stats.decode.received),
        "messages_rejected": ("Bus messages set aside as dead letters (undecodable or "
                              "invalid).", stats.decode.rejected),
        "duplicate_batches": ("Batches a producer re-sent, dropped.",
                              stats.duplicate_batches),
        "records_received": ("Records validated.", stats.validate.received),
        "records_rejected": ("Records rejected (each record of a rejected message).",
                             stats.validate.rejected),
        "events_late": ("Events for windows already closed, set aside.", stats.window.dropped),
        "events_rejected": ("Events the window engine rejected.", stats.window.rejected),
        "events_replayed": ("Events re-read after a restart for windows already written, "
                            "skipped.", stats.replayed_events),
        "steps_outlasting": ("Step records filed in the window they ended in, the one they "
                             "started in being written already (steps longer than a "
                             "window).", stats.steps_outlasting),
        "windows_closed": ("Windows closed and run through the detectors.",
                           stats.detect.received),
        "findings": ("Findings the detectors reported (any score).", stats.detect.emitted),
        "early_flags": ("Findings raised from step records and stall reports before their "
                        "window closed (the early flag).", stats.early_flags),
        "sink_windows_written": ("Windows written to the store.", stats.sink.emitted),
        "sink_windows_dropped": ("Windows dropped after the sink kept failing.",
                                 stats.sink.dropped),
        "sink_retries": ("Sink writes retried.", stats.sink_retries),
        "commits": ("Offset commits.", stats.commits),
        "commit_failures": ("Offset commits the bus refused.", stats.commit_failures),
        "poll_failures": ("Polls of the bus that failed.", stats.poll_failures),
        "jobs_evicted": ("Jobs forgotten beyond --max-jobs.", stats.jobs_evicted),
        "capped_messages": ("Valid messages set aside as dead letters because they would "
                            "pass a cap (--max-functions-per-rank, --max-functions-per-job, "
                            "--max-open-windows).", stats.capped_messages),
        "capped_rows": ("Summary rows and span events of the capped messages.",
                        stats.capped_rows),
        "op_trace_ops_written": ("Ops of what-if op traces written to the store.",
                                 stats.op_traces.emitted),
        "op_trace_ops_rejected": ("Ops of op-trace messages set aside as dead letters.",
                                  stats.op_traces.rejected),
        "op_trace_ops_dropped": ("Ops of op traces not written (no store, or the sink kept "
                                 "failing).", stats.op_traces.dropped),
    }


def _notifier_metrics(stats: NotifierStats) -> Iterator[Metric]:
    prefix = "trainscope_alertmanager_"
    for name, doc, value in (
        ("alerts_fired", "Alerts that started firing.", stats.alerts_fired),
        ("alerts_resolved", "Alerts that resolved.", stats.alerts_resolved),
        ("alerts_sent", "Alert states Alertmanager accepted (re-sends included).",
         stats.alerts_sent),
        ("posts", "Posts to Alertmanager.", stats.posts),
        ("posts_failed", "Posts that failed (their alerts were queued again).",
         stats.posts_failed),
        ("alerts_dropped", "Alert states dropped: the queue was full, or they were still "
                           "queued at shutdown.", stats.dropped),
    ):
        yield CounterMetricFamily(prefix + name, doc, value=value)
    yield GaugeMetricFamily(prefix + "queued", "Alert states waiting to be sent.",
                            value=stats.queued)
    yield GaugeMetricFamily(prefix + "firing", "Alerts firing now.", value=stats.firing)


def _copy(values: dict[str, float]) -> dict[str, float]:
    """A copy of a dict another thread may be growing (a new detector's first window)."""
    for _ in range(3):
        try:
            return dict(values)
        except RuntimeError:
            continue
    return {}


def serve_metrics(collector: PipelineCollector, port: int, bind: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` from a registry of its own (not the process-wide default one) on a
    daemon thread."""
    registry = CollectorRegistry()
    registry.register(collector)
    start_http_server(port, addr=bind, registry=registry)
    log.info("metrics at http://%s:%d/metrics", bind, port)
