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
            ("records_published", "Records handed to the bus.", stats.records_published),
            ("messages_published", "Bus messages handed to the bus.", stats.messages_published),
            ("bytes_published", "Bytes handed to the bus.", stats.bytes_published),
            ("publish_errors", "Publishes or flushes the bus refused.", stats.publish_errors),
            ("records_dropped", "Records dropped (bounded series, backlog full, shutdown).",
             stats.dropped_records),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
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
