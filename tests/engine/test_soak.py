"""A one-minute run of the soak benchmark: the pipeline process keeps up with a live 64-rank job
at >= 10k span events/s, commits while windows are open, its memory levels off, and a restart
after a SIGKILL restores its open windows from the checkpoint and re-reads less than one
window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks" / "bench_soak.py"


@pytest.mark.kafka
@pytest.mark.slow
def test_one_minute_soak() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--minutes", "1", "--sample-s", "3",
                           "--json"], capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["events_per_s"] >= 10_000, result
    assert result["late_events"] == 0 and result["late_events_after_restart"] == 0, result
    # One commit per closed window or so: ~4 windows close per wall-clock second of 15.
    assert result["commits"] >= result["windows"] // 2, result
    rss = result["rss_mb"]
    assert rss["max_second_half"] <= 1.3 * rss["max_first_half"], result["rss_samples"]
    # The windows open at the kill come back from the checkpoint; the restart re-reads only
    # what arrived after the last commit (commits every second): under one window's worth.
    assert result["restored_open_windows"] > 0, result
    assert result["reread_messages"] < result["messages_per_window"], result
