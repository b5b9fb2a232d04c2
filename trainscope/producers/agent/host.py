"""Host counters that need no privileges: CPU busy share and NIC throughput, from /proc.

They are the agent's floor: on a host with no GPU driver and no BPF permission the agent still
publishes these, and they help tell CPU contention or a saturated NIC from a GPU problem.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from trainscope.producers.agent.base import CollectorStats
from trainscope.schemas import metrics as m
from trainscope.schemas.records import MetricSample


def read_cpu_ticks(proc_root: Path = Path("/proc")) -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs since boot, from the ``cpu`` line of /proc/stat."""
    with open(proc_root / "stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user/nice
    return total - idle, total


def read_net_bytes(proc_root: Path = Path("/proc")) -> tuple[int, int]:
    """(tx, rx) bytes since boot over all interfaces but loopback, from /proc/net/dev."""
    tx = rx = 0
    with open(proc_root / "net" / "dev") as dev:
        for line in dev.readlines()[2:]:
            name, _, data = line.partition(":")
            if name.strip() == "lo":
                continue
            fields = data.split()
            rx += int(fields[0])
            tx += int(fields[8])
    return tx, rx


class HostCollector:
    name = "host"

    def __init__(
        self,
        *,
        host: str = "",
        job_id: str = "unknown",
        proc_root: Path = Path("/proc"),
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.host = host
        self.job_id = job_id
        self.proc_root = proc_root
        self.clock_ns = clock_ns
        self.stats = CollectorStats()
        self._previous: tuple[int, tuple[int, int], tuple[int, int]] | None = None

    def start(self) -> None:
        self._previous = self._read()

    def _read(self) -> tuple[int, tuple[int, int], tuple[int, int]]:
        return self.clock_ns(), read_cpu_ticks(self.proc_root), read_net_bytes(self.proc_root)

    def collect(self, window_start_ns: int, window_end_ns: int) -> list[MetricSample]:
        now = self._read()
        previous, self._previous = self._previous, now
        self.stats.events += 1
        if previous is None or now[0] <= previous[0]:
            return []
        seconds = (now[0] - previous[0]) / 1e9
        busy, total = now[1][0] - previous[1][0], now[1][1] - previous[1][1]
        values = {
            m.HOST_CPU_UTIL_PCT: 100.0 * busy / total if total > 0 else 0.0,
            m.HOST_NET_TX_BYTES_PER_S: max(now[2][0] - previous[2][0], 0) / seconds,
            m.HOST_NET_RX_BYTES_PER_S: max(now[2][1] - previous[2][1], 0) / seconds,
        }
        out = [
            MetricSample(job_id=self.job_id, host=self.host, ts_ns=now[0], name=k, value=v)
            for k, v in values.items()
        ]
        self.stats.samples += len(out)
        return out

    def stop(self, window_start_ns: int, window_end_ns: int) -> list[MetricSample]:
        return []
