"""The agent process: degraded start (no GPU, no BPF permission), isolation of a failing
collector, bounded backlog, SIGTERM handling with real probes, and what reaches the bus."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bpf_skip import cannot_load_bpf
from fakecuda import FakeCuda

from trainscope.producers.agent.aggregate import WindowAggregator
from trainscope.producers.agent.base import NO_BPF_PERMISSION, NO_GPU, NO_NVML_LIBRARY
from trainscope.producers.agent.daemon import Agent, AgentSettings
from trainscope.producers.agent.ebpf import EbpfCollector
from trainscope.producers.agent.host import HostCollector
from trainscope.schemas import metrics as m
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import (
    FunctionSummary,
    MetricBatch,
    MetricSample,
    Record,
    SummaryBatch,
)
from trainscope.schemas.summaries import summarize
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC
from trainscope.transport.memory import MemoryBus

REPO = Path(__file__).resolve().parents[3]


def published(bus: MemoryBus, topic: str) -> list[Record]:
    consumer = bus.consumer([topic], group=f"test-{topic}")
    records: list[Record] = []
    while batch := consumer.poll(timeout_s=0):
        for message in batch:
            records.extend(decode_batch(message.value))
    return records


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainscope.cli.agent", *args]


def without_capabilities(command: list[str]) -> list[str]:
    """Run as a process without any capability: root with an empty bounding set, or a plain
    user as is. This is the real situation of an agent in a container without CAP_BPF."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop capabilities when running as root"
    return [setpriv, "--inh-caps=-all", "--bounding-set=-all", "--", *command]


def final_stats(stderr: str) -> dict:
    lines = [ln for ln in stderr.splitlines() if "stopped; stats: " in ln]
    assert len(lines) == 1, stderr
    return json.loads(lines[0].split("stopped; stats: ", 1)[1])


def wait_for_line(proc: subprocess.Popen[str], text: str, timeout_s: float) -> list[str]:
    """Read stderr lines until one contains ``text``; returns the lines read."""
    assert proc.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    raise AssertionError(f"no line with {text!r} within {timeout_s}s; got {seen}")


def test_degraded_start_reports_each_missing_collector_once_and_keeps_publishing() -> None:
    command = without_capabilities(agent_command("--interval", "0.1", "--window", "0.3", "-v"))
    proc = subprocess.Popen(
        command,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        head = wait_for_line(proc, "window 3:", timeout_s=60)
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = "".join(head) + rest
    assert proc.returncode == 0, stderr
    assert stderr.count("nothing leaves the host") == 1
    ebpf_lines = [ln for ln in stderr.splitlines() if "collector ebpf not started" in ln]
    assert len(ebpf_lines) == 1 and NO_BPF_PERMISSION in ebpf_lines[0], stderr
    assert "capabilities 0x0" in ebpf_lines[0]
    stats = final_stats(stderr)
    assert stats["collectors"]["ebpf"]["status"] == "unavailable"
    assert stats["collectors"]["ebpf"]["kind"] == NO_BPF_PERMISSION
    if not Path("/dev/nvidiactl").exists():  # this host has no NVIDIA GPU
        nvml_lines = [ln for ln in stderr.splitlines() if "collector nvml not started" in ln]
        assert len(nvml_lines) == 1, stderr
        assert stats["collectors"]["nvml"]["kind"] in (NO_NVML_LIBRARY, NO_GPU)
    # What it could run, it ran and published.
    assert stats["collectors"]["host"]["status"] == "stopped"
    assert stats["windows"] >= 3 and stats["records_published"] > 0
    assert stats["publish_errors"] == 0 and stats["records_dropped"] == 0


def test_a_failing_collector_is_isolated(tmp_path: Path) -> None:
    fake_proc = tmp_path / "proc"
    (fake_proc / "net").mkdir(parents=True)
    shutil.copy("/proc/stat", fake_proc / "stat")
    shutil.copy("/proc/net/dev", fake_proc / "net" / "dev")
    broken = HostCollector(proc_root=fake_proc)
    broken.name = "host-broken"
    bus = MemoryBus()
    settings = AgentSettings(interval_s=0.02, window_s=0.04, max_consecutive_failures=3)
    agent = Agent(settings, bus, [broken, HostCollector()])
    agent.start()
    shutil.rmtree(fake_proc)  # from now on every read of the broken collector fails for real
    stats = agent.run(max_windows=6)
    state = stats.collectors["host-broken"]
    assert state.status == "failed" and "FileNotFoundError" in state.reason
    assert state.stats.errors == 3
    assert stats.collectors["host"].status == "stopped"
    sent = published(bus, METRICS_TOPIC)
    assert not [r for r in sent if isinstance(r, MetricSample)], "samples sent as rows"
    samples = [s for r in sent if isinstance(r, MetricBatch) for s in r.to_records()]
    assert {s.name for s in samples} == {
        m.HOST_CPU_UTIL_PCT,
        m.HOST_NET_TX_BYTES_PER_S,
        m.HOST_NET_RX_BYTES_PER_S,
    }
    assert len(samples) == 3 * stats.windows  # one condensed sample per series per window


def test_backlog_is_bounded_when_the_bus_refuses() -> None:
    bus = MemoryBus()
    bus.close()  # a real bus that refuses every publish
    settings = AgentSettings(interval_s=0.01, window_s=0.01, queue_size=6)
    agent = Agent(settings, bus, [HostCollector()])
    agent.start()
    stats = agent.run(max_windows=8)
    assert stats.messages_published == 0 and stats.publish_errors > 0
    # Every record the agent made (the collector's three series condensed per window, one
    # window per interval here, sent as one metric batch) was lost and counted: dropped when
    # the queue was full, failed when nothing could send them at shutdown.
    assert stats.collectors["host"].stats.samples == 3 * stats.windows
    assert stats.records_submitted == stats.windows
    assert stats.records_dropped > 0 and stats.records_failed == 6
    assert stats.records_dropped + stats.records_failed == stats.records_submitted


def test_window_aggregation_reducers_and_bound() -> None:
    agg = WindowAggregator(max_series=4)

    def sample(name: str, value: float) -> MetricSample:
        return MetricSample(job_id="j", rank=1, device=0, ts_ns=1, name=name, value=value)

    agg.add(
        [
            sample(m.SM_CLOCK_MHZ, 1000),
            sample(m.SM_CLOCK_MHZ, 2000),
            sample(m.THROTTLE_REASONS, 0x4),
            sample(m.THROTTLE_REASONS, 0x40),
            sample(m.THROTTLE_REASONS, 0x1),  # idle: a reason, but not throttling
            sample(m.XID_EVENTS, 1),
            sample(m.XID_EVENTS, 1),
            sample(m.PCIE_REPLAY_COUNT, 7),
            sample(m.PCIE_REPLAY_COUNT, 9),
            sample(m.POWER_W, 300),
        ]
    )  # a fifth series: over the bound
    s1 = summarize(
        [100, 200],
        job_id="j",
        rank=1,
        layer="cuda_api",
        name="f",
        window_start_ns=0,
        window_end_ns=1,
    )
    agg.add([s1])  # also over the bound
    assert agg.dropped == 2
    out = {r.name: r for r in agg.flush(10, 20)}
    assert {k: v.value for k, v in out.items()} == {  # type: ignore[union-attr]
        m.SM_CLOCK_MHZ: 1500,
        m.THROTTLE_REASONS: 0x45,
        m.THROTTLED_FRAC: 2 / 3,
        m.XID_EVENTS: 2,
        m.PCIE_REPLAY_COUNT: 9,
    }
    assert all(r.ts_ns == 20 for r in out.values())  # type: ignore[union-attr]
    agg.add([s1, s1])
    [batch] = agg.flush(20, 30)
    assert isinstance(batch, SummaryBatch)
    [merged] = batch.to_summaries()
    assert (merged.count, merged.total_ns, merged.window_start_ns) == (4, 600, 20)


def test_agent_publishes_ebpf_summaries_to_the_bus(fake_cuda: FakeCuda) -> None:
    proc = subprocess.Popen(
        [str(fake_cuda.driver), "cudaMemcpy:300:0:64:0", "ncclAllReduce:40:0:256:7"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANK": "2", "TRAINSCOPE_JOB_ID": "bus-job"},
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        collector = EbpfCollector(pids=[proc.pid])
        bus = MemoryBus()
        agent = Agent(AgentSettings(interval_s=0.05, window_s=0.1), bus, [collector])
        agent.start()
        state = agent.stats.collectors["ebpf"]
        if state.status != "running":
            cannot_load_bpf(f"({state.kind}): {state.reason}")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while proc.stdout.readline().strip() != "done":
            pass
        agent.run(max_windows=2)
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = published(bus, EVENTS_TOPIC)
    assert not [r for r in records if isinstance(r, FunctionSummary)]  # batches only
    summaries = [s for r in records if isinstance(r, SummaryBatch) for s in r.to_summaries()]
    counts: dict[str, int] = {}
    for s in summaries:
        assert (s.job_id, s.rank) == ("bus-job", 2)
        counts[s.name] = counts.get(s.name, 0) + s.count
    assert counts["cudaMemcpy"] == 300 and counts["ncclAllReduce"] == 40
    assert collector.probes_attached == 0  # detached at shutdown


def test_sigterm_detaches_probes_and_reports_what_was_traced(fake_cuda: FakeCuda) -> None:
    proc = subprocess.Popen(
        [str(fake_cuda.driver), "cudaLaunchKernel:777:0:0:0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    agent_proc = None
    try:
        assert proc.stdout.readline().strip() == "ready"
        agent_proc = subprocess.Popen(
            agent_command(
                "--pid", str(proc.pid), "--no-nvml", "--interval", "0.1", "--window", "0.2", "-v"
            ),
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        head = wait_for_line(agent_proc, "collectors running:", timeout_s=60)
        if "collector ebpf not started" in "".join(head):
            agent_proc.kill()
            cannot_load_bpf("".join(head))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while proc.stdout.readline().strip() != "done":
            pass
        head += wait_for_line(agent_proc, "window", timeout_s=30)
        agent_proc.send_signal(signal.SIGTERM)
        _, rest = agent_proc.communicate(timeout=30)
        stderr = "".join(head) + rest
        assert agent_proc.returncode == 0, stderr
        # The probes are gone: the library's calls are no longer traced.
        events = Path("/sys/kernel/tracing/uprobe_events")
        if events.exists():
            assert str(fake_cuda.directory).replace("/", "_") not in events.read_text()
    finally:
        for p in (proc, agent_proc):
            if p is not None and p.poll() is None:
                p.kill()
    stats = final_stats(stderr)
    ebpf = stats["collectors"]["ebpf"]
    assert ebpf["status"] == "stopped"
    launches = ebpf["stats"]["events"]
    # Every launch was traced once; the process's context switches add sched events.
    assert launches >= 777
    assert stats["records_published"] > 0 and stats["records_dropped"] == 0
