"""The eBPF collector against real uprobes on gcc-built libraries that carry CUDA/NCCL names.

Needs root, bcc, kernel headers and tracefs (``infra/ebpf-host-setup.sh``). The tests skip only
when the BPF program truly cannot load here, with the collector's own reason.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from bpf_skip import cannot_load_bpf
from fakecuda import FakeCuda

from trainscope.producers.agent.base import CollectorUnavailable
from trainscope.producers.agent.ebpf import EbpfCollector, sketch_to_log2_slots
from trainscope.schemas.records import FunctionSummary

US = 1000
MS = 1000 * US


class Driver:
    """The stand-in training process: waits for "go", runs its plan, waits to be released."""

    def __init__(self, fake: FakeCuda, items: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [str(fake.driver), *items],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        self._expect("ready")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == word, f"driver said {line!r}, expected {word!r} (rc={self.proc.poll()})"

    def _say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def go(self) -> None:
        self._say("go")

    def wait_done(self) -> dict[str, tuple[int, dict[int, int]]]:
        """Wait for the plan to finish; per function, the driver's own timings around each
        call: total ns and log2-slot counts."""
        assert self.proc.stdout is not None
        timings: dict[str, tuple[int, dict[int, int]]] = {}
        while (line := self.proc.stdout.readline().strip()) != "done":
            assert line.startswith("stat "), f"driver said {line!r} (rc={self.proc.poll()})"
            _, name, total, *pairs = line.split()
            old_total, slots = timings.get(name, (0, {}))
            for pair in pairs:
                slot, count = map(int, pair.split(":"))
                slots[slot] = slots.get(slot, 0) + count
            timings[name] = (old_total + int(total), slots)
        return timings

    def release(self) -> None:
        if self.proc.poll() is None:
            self._say("bye")
        self.proc.wait(timeout=10)


@contextmanager
def driver(fake: FakeCuda, items: list[str], **env: str) -> Iterator[Driver]:
    d = Driver(fake, items, env)
    try:
        yield d
    finally:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()


def started(collector: EbpfCollector) -> EbpfCollector:
    try:
        collector.start()
    except CollectorUnavailable as exc:
        cannot_load_bpf(f"({exc.kind}): {exc.reason}")
    return collector


def window() -> tuple[int, int]:
    now = time.time_ns()
    return now - 1_000_000_000, now


def by_name(summaries: list[FunctionSummary]) -> dict[str, FunctionSummary]:
    out: dict[str, FunctionSummary] = {}
    for s in summaries:
        assert s.name not in out, f"two summaries for {s.name} in one read"
        out[s.name] = s
    return out


def test_counts_latency_buckets_bytes_and_identity(fake_cuda: FakeCuda) -> None:
    # name: calls, delay (µs), element count, NCCL datatype (7 = float32: 4 bytes)
    plan = {
        "cudaLaunchKernel": (2000, 0, 0, 0),
        "cudaMemcpy": (30, 0, 4096, 0),
        "cudaMemcpyAsync": (40, 0, 512, 0),
        "cudaMemset": (10, 0, 100, 0),
        "cudaStreamSynchronize": (25, 3000, 0, 0),
        "cudaDeviceSynchronize": (3, 12000, 0, 0),
        "ncclAllReduce": (9, 12000, 1 << 20, 7),
        "ncclAllGather": (4, 0, 1000, 6),
        "ncclReduceScatter": (5, 0, 1000, 9),
        "ncclBroadcast": (6, 0, 10, 8),
        "ncclSend": (7, 3000, 256, 0),
        "ncclRecv": (8, 0, 256, 4),
    }
    type_size = {0: 1, 4: 8, 6: 2, 7: 4, 8: 8, 9: 2}
    items = [f"{n}:{c}:{d}:{e}:{t}" for n, (c, d, e, t) in plan.items()]
    with driver(fake_cuda, items, RANK="3", TRAINSCOPE_JOB_ID="job-ebpf") as proc:
        collector = started(EbpfCollector(pids=[proc.pid], default_job_id="fallback"))
        try:
            assert collector.tracked_pids == {proc.pid}
            # Six runtime calls in one library, six NCCL calls in the other, entry + return.
            assert collector.probes_attached == 2 * len(plan)
            proc.go()
            outer = proc.wait_done()
            summaries = collector.collect(*window())
        finally:
            summaries_at_stop = collector.stop(*window())
        proc.release()
    # Every call was read in the interval (the process may still be scheduled afterwards).
    assert [s for s in summaries_at_stop if s.layer != "sched"] == []
    got = by_name(summaries)
    assert set(plan) <= set(got), f"missing: {set(plan) - set(got)}"
    for name, (calls, delay_us, elements, dtype) in plan.items():
        s = got[name]
        assert (s.job_id, s.rank) == ("job-ebpf", 3)
        assert s.layer == ("collective" if name.startswith("nccl") else "cuda_api")
        assert s.count == calls, name
        slots = sketch_to_log2_slots(s.sketch_keys, s.sketch_counts)
        assert sum(slots.values()) == calls, name
        assert s.min_ns <= s.max_ns and s.min_ns * calls <= s.total_ns <= s.max_ns * calls
        # Each call's probe-measured latency lies between its delay (the driver sleeps at least
        # that long inside the function) and the driver's own timing around the call, which
        # also contains the probes' overhead. So, slot by slot: the probes' histogram starts
        # no lower than the delay's slot, and has at least as many calls at or below any slot
        # as the driver's histogram.
        outer_total_ns, outer_slots = outer[name]
        assert sum(outer_slots.values()) == calls
        lowest = (delay_us * US).bit_length() - 1 if delay_us else 0
        assert min(slots) >= lowest, f"{name}: {slots} below the delay's slot {lowest}"
        for slot in range(64):
            probe_le = sum(c for k, c in slots.items() if k <= slot)
            outer_le = sum(c for k, c in outer_slots.items() if k <= slot)
            assert probe_le >= outer_le, f"{name}: probes {slots} vs driver {outer_slots}"
        assert calls * delay_us * US <= s.total_ns <= outer_total_ns, name
        assert s.min_ns >= delay_us * US
        if not delay_us:
            # An un-delayed call costs the probes' own overhead (µs): below 1 ms at the median.
            median_slot = sorted(k for k, c in slots.items() for _ in range(c))[calls // 2]
            assert median_slot < 20, f"{name}: {slots}"
        size = 1 if name.startswith("cuda") else type_size[dtype]
        assert s.bytes_total == calls * elements * size, name
    # The driver's threads slept at least their delays: all of it is off-CPU time.
    slept_ns = sum(c * d * US for c, d, _, _ in plan.values())
    assert got["off_cpu"].layer == "sched"
    assert got["off_cpu"].total_ns >= slept_ns


def test_concurrent_threads_count_exactly(fake_cuda: FakeCuda) -> None:
    items = ["cudaLaunchKernel:20000:0:0:0"] * 4
    with driver(fake_cuda, items) as proc:
        collector = started(EbpfCollector(pids=[proc.pid], default_job_id="j"))
        try:
            proc.go()
            proc.wait_done()
            got = by_name(collector.collect(*window()))
        finally:
            collector.stop(*window())
        proc.release()
    assert got["cudaLaunchKernel"].count == 80_000
    assert (got["cudaLaunchKernel"].job_id, got["cudaLaunchKernel"].rank) == ("j", -1)
    assert collector.stats.dropped == 0


def test_no_call_lost_or_doubled_across_interval_flips(fake_cuda: FakeCuda) -> None:
    # About a second of paced calls, read every ~50 ms while they happen.
    total = 30_000
    with driver(fake_cuda, [f"cudaLaunchKernel:{total}:0:0:0:30000"]) as proc:
        collector = started(EbpfCollector(pids=[proc.pid]))
        counts: list[int] = []
        try:
            proc.go()
            assert proc.proc.stdout is not None
            os.set_blocking(proc.proc.stdout.fileno(), False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                line = proc.proc.stdout.readline()
                reads = [s for s in collector.collect(*window()) if s.name == "cudaLaunchKernel"]
                counts.extend(s.count for s in reads)
                if line.strip() == "done":
                    break
                time.sleep(0.05)  # the interval between two reads, not a wait for a result
            counts.extend(
                s.count for s in collector.stop(*window()) if s.name == "cudaLaunchKernel"
            )
        finally:
            collector.stop(*window())
        os.set_blocking(proc.proc.stdout.fileno(), True)
        proc.release()
    assert sum(counts) == total
    assert len([c for c in counts if c]) >= 3, f"calls were not spread over reads: {counts}"


def test_only_tracked_processes_are_summarised(fake_cuda: FakeCuda) -> None:
    items = ["cudaLaunchKernel:500:0:0:0"]
    with driver(fake_cuda, items, RANK="0") as traced, driver(fake_cuda, items, RANK="1") as other:
        collector = started(EbpfCollector(pids=[traced.pid]))
        try:
            traced.go()
            other.go()
            traced.wait_done()
            other.wait_done()
            summaries = collector.collect(*window())
        finally:
            collector.stop(*window())
        traced.release()
        other.release()
    launches = [s for s in summaries if s.name == "cudaLaunchKernel"]
    assert [(s.rank, s.count) for s in launches] == [(0, 500)]


def test_stop_detaches_every_probe(fake_cuda: FakeCuda) -> None:
    events = next(
        (
            p
            for p in (
                Path("/sys/kernel/tracing/uprobe_events"),
                Path("/sys/kernel/debug/tracing/uprobe_events"),
            )
            if p.exists()
        ),
        None,
    )
    with driver(fake_cuda, ["cudaLaunchKernel:1:0:0:0"]) as proc:
        collector = started(EbpfCollector(pids=[proc.pid]))
        assert collector.probes_attached > 0
        collector.stop(*window())
        assert collector.probes_attached == 0
        proc.go()
        proc.wait_done()
        proc.release()
    if events is not None:
        marker = str(fake_cuda.directory).replace("/", "_").replace(".", "_")
        assert marker not in events.read_text()


def test_only_selected_functions_are_probed(fake_cuda: FakeCuda) -> None:
    with pytest.raises(ValueError, match="cudaLunchKernel"):
        EbpfCollector(functions=["cudaLunchKernel"])
    items = ["cudaLaunchKernel:300:0:0:0", "cudaMemcpy:20:0:8:0", "ncclSend:5:0:1:0"]
    with driver(fake_cuda, items) as proc:
        collector = started(EbpfCollector(pids=[proc.pid], functions=["cudaMemcpy", "ncclSend"]))
        try:
            assert collector.probes_attached == 4
            proc.go()
            proc.wait_done()
            got = by_name(collector.collect(*window()))
        finally:
            collector.stop(*window())
        proc.release()
    assert "cudaLaunchKernel" not in got
    assert (got["cudaMemcpy"].count, got["ncclSend"].count) == (20, 5)
