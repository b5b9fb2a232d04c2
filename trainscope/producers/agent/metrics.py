"""The host agent's health at ``/metrics`` (Prometheus text), read from its own counters.

A custom ``prometheus_client`` collector over :class:`~trainscope.producers.agent.daemon.AgentStats`
and each collector's :class:`~trainscope.producers.agent.base.CollectorStats`: one set of
counters, read at each scrape on the HTTP server's thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from trainscope.producers.agent.daemon import Agent

PREFIX = "trainscope_agent_"


class AgentCollector:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        stats = self.agent.stats
        for name, doc, value in (
            ("intervals", "Collection intervals run.", stats.intervals),
            ("windows", "Windows published.", stats.windows),
            ("records_submitted", "Condensed records handed to the outbox.",
             stats.records_submitted),
            ("records_published", "Records the bus acknowledged.", stats.records_published),
            ("messages_published", "Bus messages the bus acknowledged.",
             stats.messages_published),
            ("bytes_published", "Bytes of the messages the bus acknowledged.",
             stats.bytes_published),
            ("publish_errors", "Failures to reach the bus, publish or flush (retried).",
             stats.publish_errors),
            ("records_dropped", "Records refused because the outbox was full (drop newest).",
             stats.records_dropped),
            ("records_failed", "Records given up: not acknowledged when the agent stopped.",
             stats.records_failed),
            ("readings_dropped", "Collector readings refused by the window's series bound.",
             stats.readings_dropped),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + "records_queued",
                                "Records held for the bus now (waiting or in flight).",
                                value=stats.records_queued)
        per_collector = {
            "collector_samples": ("Records each collector produced.", "samples"),
            "collector_events": ("Raw observations behind them.", "events"),
            "collector_dropped": ("Observations each collector lost.", "dropped"),
            "collector_errors": ("Failed collection attempts.", "errors"),
        }
        states = dict(stats.collectors)
        for name, (doc, attribute) in per_collector.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["collector"])
            for collector, state in sorted(states.items()):
                family.add_metric([collector], getattr(state.stats, attribute))
            yield family
        running = GaugeMetricFamily(PREFIX + "collector_running",
                                    "1 while the collector runs (0: unavailable, failed, stopped).",
                                    labels=["collector"])
        for collector, state in sorted(states.items()):
            running.add_metric([collector], 1.0 if state.status == "running" else 0.0)
        yield running


def serve_metrics(agent: Agent, port: int, bind: str = "127.0.0.1") -> None:
    """Serve ``/metrics`` on a daemon thread, from a registry of its own."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    start_http_server(port, addr=bind, registry=registry)
