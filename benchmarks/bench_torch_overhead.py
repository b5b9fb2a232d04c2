"""Per-step cost of the in-process PyTorch producer on a training loop (CPU, or a GPU).

Measured in one run against the same loop without trainscope, interleaving the configurations
block by block (the machine is shared and noisy):

- ``attach``: ``trainscope.attach()`` always-on layer (hooks, windowed summaries, sender);
- with ``--profilers``, also ``torch.profiler`` (the loop inside ``torch.profiler.profile()``,
  what users do today) and ``on-demand`` (steps inside an on-demand profiling window).

Each round runs a baseline block, the configurations in a shuffled order, and a second baseline
block; a block is ``--steps`` steps after ``--warmup``. A block's figure is the **CPU time** of
the whole process per step (``time.process_time_ns``: the producer's sender thread counts, the
other work on the machine does not), with the process pinned to one core where the OS allows
(``os.sched_setaffinity``). Per round: the fixed cost = the configuration's figure minus the
mean of the two baseline blocks (µs per step), and the ratio = its figure over that mean.
Printed: median and min–max over the rounds.

Targets (issue 24): ≤ 20 µs per step at 1–2 ms steps, ratio ≤ 1.004 at ~20 ms steps.

With ``--device cuda`` the attached blocks also time forward, backward and the optimizer step
on the device (CUDA events, ``producers/torch/device_timing.py``: on by itself once the model's
input is on a CUDA device); the last line says in how many blocks it was on, and how many
phase timings were resolved or dropped.

The model is a class of the script's own around a 3-layer MLP (``--sequential``: the bare
``nn.Sequential``, one of torch's own classes, whose forward is timed by module hooks instead).

Usage: ``python benchmarks/bench_torch_overhead.py [--rounds 15] [--sizes 256x48:200,1024x128:15]
[--block-s 4] [--split-s 2] [--profilers] [--device cuda] [--sequential]``.
"""

from __future__ import annotations

import argparse
import os
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


class MLP(torch.nn.Module):
    """The script's own model class, as in a real training script."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_loop(width: int, batch: int, device: str = "cpu",
              sequential: bool = False) -> Callable[[int], list[int]]:
    model = (MLP(width).body if sequential else MLP(width)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(batch * 8, width),
                                          torch.randint(0, 10, (batch * 8,)))
    loader = torch.utils.data.DataLoader(data, batch_size=batch)

    def run(steps: int) -> list[int]:
        """Runs ``steps`` steps; returns the training thread's CPU ns of each."""
        cpu_ns = []
        it = iter(loader)
        for _ in range(steps):
            start = time.thread_time_ns()
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
            cpu_ns.append(time.thread_time_ns() - start)
        return cpu_ns

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
        stats = handle.stats()
        DEVICE_TIMING["blocks"] += 1
        DEVICE_TIMING["on"] += int(stats["device_timing"])
        DEVICE_TIMING["resolved"] += stats["device_spans_resolved"]
        DEVICE_TIMING["dropped"] += stats["device_spans_dropped"]


# Whether the attached blocks timed their phases on the device too (CUDA events: on by
# itself once the model's input is on a CUDA device), and what became of those timings.
DEVICE_TIMING = {"blocks": 0, "on": 0, "resolved": 0, "dropped": 0}


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


PROFILERS = {"torch.profiler": torch_profiler, "on-demand": on_demand}


class Block:
    """One block's CPU time: the whole process's per step, and its quiet-step estimate."""

    def __init__(self, steps_ns: list[int], process_ns: int, thread_ns: int) -> None:
        steps = len(steps_ns)
        self.per_step_s = process_ns / steps / 1e9
        # Other work on a shared machine only ever adds to a step (a context switch, caches
        # refilled after it), so the lower quartile of the training thread's per-step CPU time
        # is the least disturbed figure; the other threads' CPU (the sender) is added per step.
        quartile = sorted(steps_ns)[steps // 4]
        self.quiet_step_s = (quartile + (process_ns - thread_ns) / steps) / 1e9
        self.thread_step_s = thread_ns / steps / 1e9
        self.other_threads_step_s = (process_ns - thread_ns) / steps / 1e9


def measure(run: Callable[[int], list[int]], config: Callable[[], object], warmup: int,
            steps: int) -> Block:
    """CPU time over ``steps`` steps after ``warmup``."""
    with config():  # type: ignore[attr-defined]
        run(warmup)
        process, thread = time.process_time_ns(), time.thread_time_ns()
        steps_ns = run(steps)
        return Block(steps_ns, time.process_time_ns() - process, time.thread_time_ns() - thread)


def pin_to_one_core(cpu: int | None) -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "not pinned (no sched_setaffinity here)"
    allowed = sorted(os.sched_getaffinity(0))
    chosen = allowed[-1] if cpu is None else cpu
    os.sched_setaffinity(0, {chosen})
    return f"pinned to CPU {chosen}"


def spread(values: list[float], scale: float, fmt: str) -> str:
    return (f"{format(statistics.median(values) * scale, fmt)} "
            f"({format(min(values) * scale, fmt)}–{format(max(values) * scale, fmt)})")


def bench_size(run: Callable[[int], list[int]], configs: dict[str, Callable[[], object]],
               args: argparse.Namespace, steps: int, rng: random.Random) -> None:
    """Long because it runs the interleaved rounds and prints their three figures."""
    run(args.warmup)
    if args.block_s:
        # Blocks long against the sender thread's period (0.5 s) and the window (2 s): a
        # block's figure then holds its fair share of that periodic work, not all or none.
        sample = run(50)
        steps = max(10, round(args.block_s / (statistics.median(sample) / 1e9)))
        print(f"  {steps} steps per block (about {args.block_s:g} s)")
    costs: dict[str, list[float]] = {name: [] for name in configs}
    training: dict[str, list[float]] = {name: [] for name in configs}
    quiet: dict[str, list[float]] = {name: [] for name in configs}
    ratios: dict[str, list[float]] = {name: [] for name in configs}
    base_times = []
    for _ in range(args.rounds):
        order = list(configs)
        rng.shuffle(order)
        # Baseline before and after the round's configurations, averaged, so a drift of
        # the machine's speed within a round does not land on one configuration.
        before = measure(run, baseline, args.warmup, steps)
        results = {name: measure(run, configs[name], args.warmup, steps) for name in order}
        after = measure(run, baseline, args.warmup, steps)
        base = (before.per_step_s + after.per_step_s) / 2
        quiet_base = (before.quiet_step_s + after.quiet_step_s) / 2
        base_times.append(base)
        for name, block in results.items():
            costs[name].append(block.per_step_s - base)
            quiet[name].append(block.quiet_step_s - quiet_base)
            ratios[name].append(block.per_step_s / base)
            training[name].append(block.thread_step_s
                                  - (before.thread_step_s + after.thread_step_s) / 2)
    print(f"  baseline CPU time per step {spread(base_times, 1e3, '.3f')} ms")
    print(f"  {'configuration':16s} {'fixed cost µs/step':>24s} {'quiet steps µs/step':>24s} "
          f"{'ratio':>24s}")
    for name in configs:
        print(f"  {name:16s} {spread(costs[name], 1e6, '.1f'):>24s} "
              f"{spread(quiet[name], 1e6, '.1f'):>24s} {spread(ratios[name], 1.0, '.4f'):>24s}")
    if args.split_s:
        split_figures(run, configs, args, training)


def split_figures(run: Callable[[int], list[int]], configs: dict[str, Callable[[], object]],
                  args: argparse.Namespace, training: dict[str, list[float]]) -> None:
    """The fixed cost as its two parts, each measured the way its noise allows.

    The training thread's extra CPU per step: the median over the rounds (short blocks, each
    paired with the baselines around it: on a shared machine a step's own time drifts by
    tens of percent within a second, and only close pairs and many of them cancel that). The
    other threads' (the sender's rounds every 0.5 s, which a short block catches only now and
    then): their CPU per step over blocks of ``--split-s`` seconds, against the same blocks
    without trainscope, alternating ``--split-blocks`` times; the median.
    """
    steps = max(10, round(args.split_s / (statistics.median(run(50)) / 1e9)))
    others: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.split_blocks):
        base = measure(run, baseline, args.warmup, steps).other_threads_step_s
        for name, config in configs.items():
            others[name].append(measure(run, config, args.warmup, steps).other_threads_step_s
                                - base)
    print(f"  split ({len(next(iter(training.values())))} rounds; {args.split_blocks} blocks of "
          f"{steps} steps for the other threads), µs/step, median (min–max):")
    for name in configs:
        thread_us = statistics.median(training[name]) * 1e6
        others_us = statistics.median(others[name]) * 1e6
        low, high = median_interval(training[name])
        print(f"  {name:16s} training thread {spread(training[name], 1e6, '.1f')} "
              f"[95% interval of the median {low * 1e6:.1f}–{high * 1e6:.1f}], "
              f"other threads {spread(others[name], 1e6, '.1f')}, "
              f"fixed cost {thread_us + others_us:.1f} "
              f"[{(low * 1e6 + others_us):.1f}–{(high * 1e6 + others_us):.1f}]")


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median from the order statistics (no assumption on
    the noise's distribution; rounds are taken as independent)."""
    ordered = sorted(values)
    n = len(ordered)
    half_width = 0.98 * n ** 0.5  # 1.96 * sqrt(n) / 2 ranks either side of the middle
    low = max(0, int(n / 2 - half_width))
    high = min(n - 1, int(n / 2 + half_width + 1))
    return ordered[low], ordered[high]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--sizes", default="256x48:200,1024x128:15",
                        help="model width x batch size : steps per block, comma-separated")
    parser.add_argument("--block-s", type=float, default=0.0,
                        help="steps per block chosen to last about this long (overrides the "
                             "steps of --sizes)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--split-s", type=float, default=0.0,
                        help="also give the fixed cost as the training thread's part (median "
                             "of the rounds) plus the other threads' (blocks of this many "
                             "seconds); for many short rounds on a noisy machine")
    parser.add_argument("--split-blocks", type=int, default=3,
                        help="blocks per configuration for the other threads' part")
    parser.add_argument("--cpu", type=int, default=None,
                        help="the core to pin to (default: the last one allowed)")
    parser.add_argument("--profilers", action="store_true",
                        help="also measure torch.profiler and an on-demand profiling window")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--sequential", action="store_true",
                        help="the model is a bare nn.Sequential (one of torch's own classes at "
                             "the top: its forward is timed by module hooks)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pinned = pin_to_one_core(args.cpu)
    rng = random.Random(0)
    configs: dict[str, Callable[[], object]] = {"attach": attached}
    if args.profilers:
        configs.update(PROFILERS)
    device = args.device
    if device != "cpu":
        print(f"device: {torch.cuda.get_device_name(torch.device(device))}")
    print(f"torch {torch.__version__}, {device}, {args.threads} thread(s), {pinned}, "
          f"{args.rounds} rounds, {args.warmup} warm-up steps per block; "
          f"figures: median (min–max) over rounds, process CPU time")
    for size in args.sizes.split(","):
        shape, _, steps = size.partition(":")
        width, batch = (int(v) for v in shape.split("x"))
        per_block = "" if args.block_s else f", {int(steps or 40)} steps per block"
        print(f"\nMLP width {width}, batch {batch}{per_block}")
        bench_size(make_loop(width, batch, device, args.sequential), configs, args,
                   int(steps or 40), rng)
    t = DEVICE_TIMING
    print(f"\ndevice timing in attach blocks: on in {t['on']} of {t['blocks']}; "
          f"{t['resolved']} phase timings resolved, {t['dropped']} dropped (event pool dry)")


if __name__ == "__main__":
    main()
