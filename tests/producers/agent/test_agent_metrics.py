"""``trainscope agent --metrics-port``: its own /metrics, scraped while it runs, moves."""

from __future__ import annotations

import subprocess
import sys

from metrics_scrape import scrape_until


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_agents_counters_move_at_metrics() -> None:
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "trainscope.cli.main", "agent", "--bus", "memory", "--no-ebpf",
         "--no-nvml", "--interval", "0.1", "--window", "0.5", "--duration", "60",
         "--metrics-port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        first = scrape_until(port, lambda m: m[("trainscope_agent_intervals_total", ())] >= 1)
        later = scrape_until(port, lambda m: m[("trainscope_agent_windows_total", ())] >= 2)
    finally:
        agent.terminate()
        _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    intervals = ("trainscope_agent_intervals_total", ())
    assert later[intervals] > first[intervals]
    host = (("collector", "host"),)
    assert later[("trainscope_agent_collector_running", host)] == 1.0
    assert later[("trainscope_agent_collector_samples_total", host)] > 0
    assert later[("trainscope_agent_records_published_total", ())] > 0
    assert later[("trainscope_agent_collector_errors_total", host)] == 0
