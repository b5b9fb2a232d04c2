"""End to end: 4-rank DDP (gloo, CPU) → attach() → real Kafka broker → pipeline → findings.

One rank is made slow — extra compute in its forward, or a sleep in its data loader — and the
findings must name that rank with the right category while the others appear only as victims.
A healthy run must raise nothing at or above the alert threshold. The same job sharded with
FSDP2 (``fully_shard``) instead of DDP, one rank sleeping outside anything we hook: its peers
wait for it in FSDP's all-gathers, and that is how it must be found.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
import uuid
from multiprocessing.connection import Connection

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.schemas.records import Finding
from trainscope.transport.bus import open_bus

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORLD = 4
SLOW_RANK = 2
WINDOW_S = 2.0
TRAIN_S = 9.0  # four complete 2-s windows after warm-up
BATCH = 16


class SleepyDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s
        self.x = torch.randn(n, 64)
        self.y = torch.randn(n, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.x[i], self.y[i]


class Net(torch.nn.Module):
    def __init__(self, extra_compute: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
        )
        self.extra_compute = extra_compute
        self.register_buffer("w", torch.randn(256, 256) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.randn(64, 256)
        for _ in range(self.extra_compute):  # the straggler's own, extra work
            h = torch.tanh(h @ self.w)
        return self.body(x) + 0.0 * h.sum()


def _worker(rank: int, port: int, bus_url: str, job_id: str, fault: str, ready: Connection) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # _run_job asks on a hang
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    import trainscope

    handle = trainscope.attach(bus=bus_url, job_id=job_id, window_s=WINDOW_S)
    slow = rank == SLOW_RANK
    net = Net(extra_compute=60 if slow and fault == "compute" else 0)
    if fault == "fsdp2-outside":
        from torch.distributed.fsdp import fully_shard

        for layer in net.body:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        model: torch.nn.Module = fully_shard(net)
    else:
        model = torch.nn.parallel.DistributedDataParallel(net)
    delay_s = 0.002 if slow and fault == "dataloader" else 0.0  # ~30 ms per batch of 16
    loader = torch.utils.data.DataLoader(SleepyDataset(10_000, delay_s), batch_size=BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    # Every rank stops at the same step: rank 0 decides when the time is up.
    stop = torch.zeros(1)
    started = time.monotonic()
    for step, (x, y) in enumerate(loader, start=1):
        if slow and fault == "fsdp2-outside":
            time.sleep(0.02)  # the script's own slow code, outside anything attach() hooks
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:
            stop.fill_(float(rank == 0 and time.monotonic() - started > TRAIN_S))
            dist.broadcast(stop, src=0)
            if stop.item():
                break
    assert handle is not None
    handle.detach()
    ready.send(handle.stats())
    dist.destroy_process_group()


def _run_job(bus_url: str, fault: str) -> tuple[str, list[Finding], list[dict]]:
    from kafka_broker import free_port

    from trainscope.engine.bus_job import BusStreamJob

    job_id = f"e2e-{fault}-{uuid.uuid4().hex[:6]}"
    bus = open_bus(bus_url)
    pipeline = BusStreamJob(bus, group=f"pipeline-{job_id}", window_s=WINDOW_S, lateness_s=3.0)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, bus_url, job_id, fault, pipes[r][1]))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    stats: list[dict] = []
    deadline = time.monotonic() + 90
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            pipeline.poll_once(timeout_s=0.2)
            for reader, _ in pipes:
                if reader.poll():
                    stats.append(reader.recv())
        for p in procs:
            p.join(10)
        for reader, _ in pipes:
            if reader.poll():
                stats.append(reader.recv())
        hung = [p for p in procs if p.is_alive()]
        for p in hung:  # every thread's stack on stderr, which pytest shows with the failure
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2 if hung else 0)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        pipeline.run(idle_timeout_s=2.0, max_seconds=15)
        pipeline.finish()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        bus.close()
    findings = [f for f in pipeline.findings if f.job_id == job_id]
    return job_id, findings, stats


def _alerts(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.score >= ALERT_THRESHOLD]


def _check_straggler(findings: list[Finding], category: str) -> None:
    alerts = _alerts(findings)
    assert alerts, f"no alert; findings: {[(f.detector, f.rank, f.category) for f in findings]}"
    named = [f for f in alerts if f.rank == SLOW_RANK and f.category == category]
    assert named, [(f.detector, f.rank, f.category, round(f.score, 2)) for f in alerts]
    others = set(range(WORLD)) - {SLOW_RANK}
    for f in alerts:
        assert f.rank not in others, f"healthy rank {f.rank} named as suspect: {f.message}"
    assert any(others <= set(f.victims) for f in named), [f.victims for f in named]


def _show(findings: list[Finding]) -> None:
    """Printed so a failing run (pytest -rA / -s) shows what the detectors said."""
    for f in findings:
        print(f"{f.detector} rank={f.rank} {f.layer}/{f.function} {f.category} "
              f"score={f.score:.2f} victims={f.victims}")


def _check_stats(stats: list[dict]) -> None:
    assert len(stats) == WORLD
    for s in stats:
        assert s["errors"] == 0, s["errors_by_kind"]
        assert s["records_dropped"] == 0 and s["records_sent"] > 0


def test_slow_forward_on_one_rank_is_named_compute(fresh_kafka_broker) -> None:
    _, findings, stats = _run_job(fresh_kafka_broker.url, "compute")
    _show(findings)
    _check_stats(stats)
    _check_straggler(findings, "compute")


def test_slow_data_loader_on_one_rank_is_named_dataloader(fresh_kafka_broker) -> None:
    _, findings, stats = _run_job(fresh_kafka_broker.url, "dataloader")
    _show(findings)
    _check_stats(stats)
    _check_straggler(findings, "dataloader")


def test_an_fsdp2_rank_slow_outside_our_hooks_is_found_by_its_peers_waits(
        fresh_kafka_broker) -> None:
    """FSDP2 calls torch.distributed's ``all_gather_single`` and ``reduce_scatter_single``;
    unhooked, the job showed no collective at all and the waiting peers' forward looked slow."""
    _, findings, stats = _run_job(fresh_kafka_broker.url, "fsdp2-outside")
    _show(findings)
    _check_stats(stats)
    _check_straggler(findings, "host")


def test_a_healthy_run_raises_no_alert(fresh_kafka_broker) -> None:
    """No rank is named and nothing else is said at the alert threshold, except what this
    machine can make true of the job as a whole: its steps slowing down (step-time
    ``slowdown``, rank -1), or its ranks taking turns waiting for a CPU (``waits``'
    job-level ``cpu-contention``, only with the run-queue wait measured). The four ranks share
    two cores with the broker, the pipeline and whatever else runs; when another process takes
    them, every step is slower and the ranks wait for a core in turn, and saying so is right
    (``test_waits_torchrun.py`` allows the same)."""
    _, findings, stats = _run_job(fresh_kafka_broker.url, "none")
    _show(findings)
    _check_stats(stats)
    alerts = [f for f in _alerts(findings)
              if not (f.rank < 0 and (
                  (f.detector == "step-time" and f.category == "slowdown")
                  or (f.detector == "waits" and f.category == "cpu-contention"
                      and f.evidence.get("runqueue_wait_ns_per_step", 0.0) > 0)))]
    assert not alerts, [(f.detector, f.rank, f.category, round(f.score, 2), f.message)
                        for f in alerts]
