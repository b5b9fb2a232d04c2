"""Scraping a process's Prometheus ``/metrics`` in the tests (the pipeline's, the agent's)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Metrics:
    """Every sample on http://127.0.0.1:PORT/metrics, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted(labels.items())))]


def scrape_until(port: int, condition: Callable[[Metrics], bool], timeout_s: float = 60.0
                 ) -> Metrics:
    """Scrape until ``condition`` holds (the server may not be listening yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            metrics = scrape(port)
        except OSError:  # not listening yet
            metrics = {}
        if metrics and condition(metrics):
            return metrics
        assert time.monotonic() < deadline, f"/metrics never got there: {metrics}"
        time.sleep(0.1)
