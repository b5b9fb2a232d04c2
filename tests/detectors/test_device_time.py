"""Detectors read a phase's device time where it came (``gpu_phase``), not its host time.

With CUDA's asynchronous execution the host returns from a phase once its kernels are queued:
a slow GPU's backward shows in the backward's device time, and on the host in whatever next
waits for the GPU (here the optimizer step). The contract's example job (2 stages x 4 ranks,
rank 5's backward 1.4x slower) is turned into what a device-timed producer sends: its
backward times become device times, the host's backward the same on every rank, and rank 5's
host optimizer step absorbs the wait; on the device, the optimizer step is the same on every
rank.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from trainscope.detectors.contract import example_windows
from trainscope.detectors.features import device_clock_view
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.registry import DetectorRunner
from trainscope.schemas.window import WindowView

SLOW = 5


def device_timed(view: WindowView) -> WindowView:
    s = view.summaries
    backward = s[s["name"] == "backward"]
    device = backward.assign(layer="gpu_phase")
    host = s.copy()
    is_backward = host["name"] == "backward"
    launch_ns = host.loc[is_backward, "count"] * 2_000_000  # 2 ms of launches per pass
    host.loc[is_backward, "total_ns"] = launch_ns
    optimizer = backward.assign(name="optimizer.step", total_ns=backward["count"] * 3_000_000)
    excess = backward.set_index("rank")["total_ns"]
    waited = excess[SLOW] - excess.drop(SLOW).median()  # the host waits for the slow GPU here
    optimizer.loc[optimizer["rank"] == SLOW, "total_ns"] += int(waited)
    # On the device the optimizer step is the same on every rank (1 ms of kernels).
    device_optimizer = optimizer.assign(layer="gpu_phase", total_ns=optimizer["count"] * 1_000_000)
    return dataclasses.replace(view, summaries=pd.concat(
        [host, device, optimizer, device_optimizer], ignore_index=True))


def test_a_slow_gpu_is_named_in_the_phase_that_ran_the_work() -> None:
    runner = DetectorRunner([PeerDiffDetector()])  # the pipeline's path: it reads the view
    found = [f for v in example_windows(3, slow_rank=SLOW) for f in runner.run(device_timed(v))]
    alerts = [f for f in found if f.score >= 0.5]
    assert {(f.rank, f.category, f.layer, f.function) for f in alerts} == {
        (SLOW, "gpu-compute", "gpu_phase", "backward")}, found
    # The host's optimizer step, which waited for it, is no finding of its own, nor is its
    # wait counted with the backward's excess.
    assert not [f for f in found if f.function == "optimizer.step"], found
    excess_ms = alerts[-1].evidence["excess_ns_per_step"] / 1e6
    assert 70 < excess_ms < 100, excess_ms  # the backward's +40% of ~200 ms, once


def test_the_device_clock_view_leaves_out_the_host_rows_of_device_timed_phases() -> None:
    view = device_timed(example_windows(1)[0])
    s = view.summaries
    # A rank without device times (another producer, a CPU process) keeps its host rows.
    s = s[~((s["rank"] == 0) & s["layer"].isin(["gpu_phase"]))]
    read = device_clock_view(dataclasses.replace(view, summaries=s)).summaries
    pairs = set(zip(read["rank"], read["layer"], read["name"], strict=True))
    assert (1, "gpu_phase", "backward") in pairs and (1, "torch_op", "backward") not in pairs
    assert (1, "torch_op", "optimizer.step") not in pairs
    assert (1, "torch_op", "forward") in pairs  # no device time came for it
    assert (0, "torch_op", "backward") in pairs and (0, "torch_op", "optimizer.step") in pairs
    assert len(read) == len(s) - 2 * 7  # two host rows of each of the 7 device-timed ranks
    untouched = example_windows(1)[0]
    assert device_clock_view(untouched) is untouched
