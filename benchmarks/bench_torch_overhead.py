"""Step-time overhead of the in-process PyTorch producer on a training loop (CPU, or a GPU).

Measured in one run, as ratios to the same loop without trainscope, interleaving the
configurations round by round (shared, noisy machines):

- ``attach``: ``trainscope.attach()`` always-on layer (hooks, windowed summaries, sender);
- ``torch.profiler``: the loop inside ``torch.profiler.profile()`` (what users do today);
- ``on-demand``: steps inside an on-demand profiling window (torch.profiler with stacks).

Each block runs ``--steps`` steps after ``--warmup``; its figure is the median step time. The
ratio of a configuration is the median over rounds of (its block / the baseline block of the
same round). Usage: ``python benchmarks/bench_torch_overhead.py [--rounds 7] [--steps 60]
[--device cuda]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

import trainscope
from trainscope.producers.torch.profiling import ProfileController
from trainscope.schemas.records import ControlMessage
from trainscope.transport.memory import MemoryBus


def make_loop(width: int, batch: int, device: str = "cpu") -> Callable[[int], list[float]]:
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(batch * 8, width),
                                          torch.randint(0, 10, (batch * 8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)

    def run(steps: int) -> list[float]:
        times = []
        it = iter(loader)
        for _ in range(steps):
            start = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                it = iter(loader)
                x, y = next(it)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if device != "cpu":
                loss.item()  # what a training loop that logs its loss waits for every step
            times.append(time.perf_counter() - start)
        return times

    return run


@contextmanager
def baseline() -> Iterator[None]:
    yield


@contextmanager
def attached() -> Iterator[None]:
    handle = trainscope.attach(bus=MemoryBus(), job_id="bench", window_s=2.0)
    try:
        yield
    finally:
        assert handle is not None
        handle.detach()


@contextmanager
def torch_profiler() -> Iterator[None]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities):
        yield


@contextmanager
def on_demand() -> Iterator[None]:
    handle = trainscope.attach(bus=MemoryBus(), job_id="bench", window_s=2.0,
                               profile_max_steps=100_000, profile_budget_s=3600)
    assert handle is not None
    controller: ProfileController = handle.profiler
    controller.request(ControlMessage(job_id="bench", action="profile", steps=100_000))
    controller.on_step_end(time.time_ns())  # the session starts at a step boundary
    assert controller.active
    try:
        yield
    finally:
        handle.detach()


CONFIGS = {
    "attach": attached,
    "torch.profiler": torch_profiler,
    "on-demand": on_demand,
}


def measure(run: Callable[[int], list[float]], config: Callable[[], object], warmup: int,
            steps: int) -> float:
    with config():  # type: ignore[attr-defined]
        run(warmup)
        return statistics.median(run(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sizes", default="256x32,1024x128",
                        help="model width x batch size, comma-separated")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    device = args.device
    if device != "cpu":
        print(f"device: {torch.cuda.get_device_name(torch.device(device))}")
    print(f"torch {torch.__version__}, {device}, {args.threads} thread(s), {args.rounds} rounds x "
          f"{args.steps} steps (+{args.warmup} warm-up) per block")
    for size in args.sizes.split(","):
        width, batch = (int(v) for v in size.split("x"))
        run = make_loop(width, batch, device)
        run(args.warmup)
        ratios: dict[str, list[float]] = {name: [] for name in CONFIGS}
        base_times = []
        for _ in range(args.rounds):
            order = list(CONFIGS)
            rng.shuffle(order)
            # Baseline before and after the round's configurations, averaged, so a drift of
            # the machine's speed within a round does not land on one configuration.
            before = measure(run, baseline, args.warmup, args.steps)
            results = {name: measure(run, CONFIGS[name], args.warmup, args.steps)
                       for name in order}
            after = measure(run, baseline, args.warmup, args.steps)
            base = (before + after) / 2
            base_times.append(base)
            for name, value in results.items():
                ratios[name].append(value / base)
        print(f"\nMLP width {width}, batch {batch}: baseline median step "
              f"{statistics.median(base_times) * 1e3:.2f} ms")
        print(f"  {'configuration':16s} {'ratio (median)':>14s} {'min':>7s} {'max':>7s}")
        for name, values in ratios.items():
            print(f"  {name:16s} {statistics.median(values):14.3f} {min(values):7.3f} "
                  f"{max(values):7.3f}")


if __name__ == "__main__":
    main()
