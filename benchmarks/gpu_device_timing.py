"""GPU check of issue 25: a kernel injected in ``forward`` shows in forward's device time.

On one CUDA GPU the same training loop (an MLP; ``loss.item()`` after every step, as a loop
that logs its loss does: the host's synchronising call) runs under ``trainscope.attach()``
twice, without and with extra work in ``forward`` every step: a chain of matmuls of about
``--extra-ms`` GPU milliseconds, timed alone with CUDA events first. From the summaries the
producer sent, per phase and step: the device time (layer ``gpu_phase``, CUDA events) and the
host time (``torch_op``). What must show: forward's device time grows by the injected work's
time, backward's and the optimizer step's do not; on the host the excess is not in
``forward`` (its kernels are only queued there) but wherever the host next waits.

It also reports the producer's own counts (device phases resolved and dropped, step records
sent before their collectives' device time was known) and, per configuration, the CPU time
per step of the loop.

``--dry-run-cpu`` runs the same script on a CPU with a **host-clock stand-in** for the CUDA
event (passed to ``attach(device_events=...)``): on a CPU the work runs as it is called, so
the stand-in's times are host times; its figures only show that the script runs end to end on
a machine without a GPU, before a GPU's scarce minutes are spent on it.

Usage: ``python benchmarks/gpu_device_timing.py [--steps 200] [--extra-ms 2] [--width 2048]
[--dry-run-cpu]``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import trainscope
from trainscope.producers.torch.device_timing import DEVICE_PHASE_LAYER
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import SummaryBatch
from trainscope.transport.bus import EVENTS_TOPIC
from trainscope.transport.memory import MemoryBus

PHASES = ("forward", "backward", "optimizer.step")
# How far a phase's device excess may be from what it should be, as a share of the injected
# work's own time (the same work timed alone and inside a loop differs by the GPU's clocks).
TOLERANCE = 0.25


class HostClockEvent:
    """Stand-in for ``torch.cuda.Event(enable_timing=True)`` on a machine without a GPU: the
    host's clock at ``record()`` (only for ``--dry-run-cpu``)."""

    def __init__(self) -> None:
        self.at_ns = 0

    def record(self, stream: Any = None) -> None:
        self.at_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return self.at_ns > 0

    def elapsed_time(self, end: HostClockEvent) -> float:
        return (end.at_ns - self.at_ns) / 1e6


class Model(torch.nn.Module):
    """A 3-layer MLP; ``extra`` runs in its forward, every call."""

    def __init__(self, width: int, extra: Callable[[torch.Tensor], None] | None) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 10))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra is not None:
            self.extra(x)
        return self.body(x)


def matmul_chain(device: str, size: int, count: int) -> Callable[[torch.Tensor], None]:
    a = torch.randn(size, size, device=device)

    def extra(_: torch.Tensor) -> None:
        z = a
        for _ in range(count):
            z = z @ a
            z = z / z.norm()  # bounded values; part of the injected work

    return extra


def time_alone(device: str, work: Callable[[torch.Tensor], None], repeats: int = 20,
               new_event: Callable[[], Any] | None = None) -> float:
    """The work's own device time in ms (median of ``repeats``), on events of its own."""
    new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
    x = torch.zeros(1, device=device)
    work(x)  # warm-up
    times = []
    for _ in range(repeats):
        start, end = new_event(), new_event()
        start.record()
        work(x)
        end.record()
        if device == "cuda":
            torch.cuda.synchronize()  # measuring the work alone, outside any attached loop
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def calibrated_extra(device: str, extra_ms: float, size: int,
                     new_event: Callable[[], Any] | None) -> tuple[Callable[[torch.Tensor], None],
                                                                   float, int]:
    one = time_alone(device, matmul_chain(device, size, 1), new_event=new_event)
    count = max(1, round(extra_ms / max(one, 1e-6)))
    work = matmul_chain(device, size, count)
    return work, time_alone(device, work, new_event=new_event), count


def run(device: str, width: int, steps: int, extra: Callable[[torch.Tensor], None] | None,
        tag: str, new_event: Callable[[], Any] | None) -> dict[str, Any]:
    bus = MemoryBus()
    handle = trainscope.attach(bus=bus, job_id=f"gpu-check-{tag}", window_s=1.0,
                               device_events=new_event)
    assert handle is not None
    model = Model(width, extra).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    cpu_started = time.process_time_ns()
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()  # the host waits for the GPU here, outside every phase
    cpu_per_step_us = (time.process_time_ns() - cpu_started) / steps / 1e3
    time.sleep(1.5)  # the last window closes and the device events resolve
    handle.detach()
    stats = handle.stats()
    per_step: dict[str, dict[str, float]] = {}
    for batch in _summary_batches(bus):
        for s in batch.to_summaries():
            if s.name in PHASES and s.layer in (DEVICE_PHASE_LAYER, "torch_op"):
                clock = "device_ms" if s.layer == DEVICE_PHASE_LAYER else "host_ms"
                entry = per_step.setdefault(s.name, {"device_ms": 0.0, "host_ms": 0.0,
                                                     "device_calls": 0, "host_calls": 0})
                entry[clock] += s.total_ns / 1e6
                entry[clock.replace("_ms", "_calls")] += s.count
    for entry in per_step.values():
        for clock in ("device", "host"):
            calls = entry[f"{clock}_calls"]
            entry[f"{clock}_ms"] = round(entry[f"{clock}_ms"] / calls, 4) if calls else None
    return {"per_call": per_step, "cpu_us_per_step": round(cpu_per_step_us, 1),
            "device_timing": stats.get("device_timing"),
            "device_spans_resolved": stats.get("device_spans_resolved"),
            "device_spans_dropped": stats.get("device_spans_dropped"),
            "device_steps_unsettled": stats.get("device_steps_unsettled"),
            "errors": stats.get("errors")}


def _summary_batches(bus: MemoryBus) -> list[SummaryBatch]:
    consumer = bus.consumer([EVENTS_TOPIC], "gpu-check")
    out: list[SummaryBatch] = []
    while messages := consumer.poll(max_records=10_000, timeout_s=0.01):
        for message in messages:
            out += [r for r in decode_batch(message.value) if isinstance(r, SummaryBatch)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--extra-ms", type=float, default=2.0,
                        help="device time of the work injected in forward (calibrated)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--matmul-size", type=int, default=1024)
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="a CPU and a host-clock stand-in event: does the script run?")
    args = parser.parse_args()
    if args.dry_run_cpu:
        device, new_event = "cpu", HostClockEvent
        gpu = "none (dry run on CPU, host-clock stand-in events)"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: run on a GPU machine, or pass --dry-run-cpu")
        device, new_event = "cuda", None  # attach() times with torch.cuda.Event by itself
        gpu = torch.cuda.get_device_name(0)
    work, extra_ms, count = calibrated_extra(device, args.extra_ms, args.matmul_size,
                                             new_event or (lambda: torch.cuda.Event(
                                                 enable_timing=True)))
    plain = run(device, args.width, args.steps, None, "plain", new_event)
    injected = run(device, args.width, args.steps, work, "injected", new_event)
    excess = {}
    for phase in PHASES:
        before, after = plain["per_call"].get(phase, {}), injected["per_call"].get(phase, {})
        excess[phase] = {clock: (round(after[clock] - before[clock], 4)
                                 if after.get(clock) is not None
                                 and before.get(clock) is not None else None)
                         for clock in ("device_ms", "host_ms")}
    forward = excess["forward"]["device_ms"]
    others = [excess[phase]["device_ms"] for phase in PHASES[1:]]
    shown = {
        # The injected work is in forward's device time, about all of it ...
        "forward_device_excess_is_the_injected_work":
            forward is not None and abs(forward - extra_ms) <= TOLERANCE * extra_ms,
        # ... and not charged to the phases after it.
        "backward_and_optimizer_device_unchanged":
            all(x is not None and abs(x) <= TOLERANCE * extra_ms for x in others),
        "no_dropped_or_unsettled_device_times": all(
            r["device_timing"] and not r["device_spans_dropped"]
            and not r["device_steps_unsettled"] and not r["errors"]
            for r in (plain, injected)),
    }
    print(json.dumps({
        "shown": shown,
        "gpu": gpu, "torch": torch.__version__, "steps": args.steps,
        "injected_ms_alone": round(extra_ms, 4), "injected_matmuls": count,
        "excess_per_step": excess,
        "forward_device_excess_over_injected": (round(forward / extra_ms, 3)
                                                if forward is not None and extra_ms else None),
        "plain": plain, "injected": injected,
    }, indent=1))


if __name__ == "__main__":
    main()
