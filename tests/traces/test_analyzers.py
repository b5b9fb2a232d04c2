"""Each analyzer fires on a trace that shows its cause and stays quiet on one that does not.

Firing traces are the real H100 ones where they show the cause (a small transformer that is
launch-bound), a real CPU run with a slow dataset, and hand-made traces for causes the
recorded ones do not have (pageable copies, exposed NCCL, long synchronisations).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from handmade import busy_gemm
from trace_data import H100_PAGEABLE, H100_PINNED, H100_TRACES

from trainscope.traces.analyzers import TraceView, breakdown, run_all
from trainscope.traces.analyzers.host import DataLoaderWaits, PageableCopies, Synchronisations
from trainscope.traces.analyzers.idle import IdleGpu
from trainscope.traces.analyzers.kernels import KernelMix
from trainscope.traces.analyzers.launches import LaunchBound, TinyKernels
from trainscope.traces.analyzers.overlap import CommOverlap
from trainscope.traces.condense import condense
from trainscope.traces.reader import read_trace


def view_of(path: Path, rank: int | None = 0) -> TraceView:
    trace = read_trace(path, rank)
    result = condense(trace, "j", 10**9)
    return TraceView(trace, result.tree, len(result.steps))


@pytest.fixture(scope="module")
def h100() -> TraceView:
    return view_of(H100_TRACES[0])


@pytest.fixture(scope="module")
def busy(tmp_path_factory) -> TraceView:
    return view_of(busy_gemm().write(tmp_path_factory.mktemp("busy") / "busy.json"))


def test_kernel_breakdown_adds_up_and_mix_rule(h100: TraceView, busy: TraceView, tmp_path):
    times = breakdown(h100)
    t = h100.trace
    assert sum(times.values()) == int(t.dur_ns[h100.device].sum())
    assert times["gemm"] > times["attention"] > 0 and times["communication"] == 0
    assert KernelMix().analyze(busy) == [] and KernelMix().analyze(h100) == []
    b = busy_gemm(n=2)
    for k in range(10):
        b.launch("aten::add_", "void at::native::vectorized_elementwise_kernel<4>", 3000 + k * 100,
                 90)
    (s,) = KernelMix().analyze(view_of(b.write(tmp_path / "ew.json")))
    assert s.at_stake_ns == 900_000 and s.where == "aten::add_"
    assert "torch.compile" in s.advice


def test_idle_gpu_on_the_h100_trace_is_host_bound(h100: TraceView, busy: TraceView) -> None:
    (s,) = IdleGpu().analyze(h100)
    busy_s, busy_e = h100.device_busy
    assert s.at_stake_ns == h100.device_span_ns - int((busy_e - busy_s).sum())
    assert s.at_stake_ns > 0.5 * h100.device_span_ns
    assert max(s.evidence, key=s.evidence.get) == "host"
    assert IdleGpu().analyze(busy) == []


def test_idle_gpu_names_the_data_loader_when_it_fills_the_gaps(tmp_path) -> None:
    b = busy_gemm(n=2)
    b.host("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 2000, 3000,
           cat="user_annotation")
    b.launch("aten::mm", "sm90_xmma_gemm", 5100, 500, host_ts_us=5050)
    (s,) = IdleGpu().analyze(view_of(b.write(tmp_path / "t.json")))
    assert max(s.evidence, key=s.evidence.get) == "data" and "num_workers" in s.advice


def test_launch_bound_and_tiny_kernels(h100: TraceView, busy: TraceView) -> None:
    (s,) = LaunchBound().analyze(h100)
    assert s.at_stake_ns > 0.5 * h100.device_span_ns and s.where.startswith("aten::")
    (tiny,) = TinyKernels().analyze(h100)
    assert tiny.evidence["tiny"] >= 100 and "fused" in tiny.advice
    assert LaunchBound().analyze(busy) == [] and TinyKernels().analyze(busy) == []


def test_pageable_copies_on_real_traces(h100: TraceView) -> None:
    (s,) = PageableCopies().analyze(view_of(H100_PAGEABLE))
    assert s.evidence["copies"] == 3 and s.evidence["bytes"] == 3 * 4096 * 1024 * 4
    assert "pin_memory=True" in s.advice and s.where == "aten::copy_"
    assert PageableCopies().analyze(view_of(H100_PINNED)) == []
    assert PageableCopies().analyze(h100) == []  # copies from pinned memory


def test_synchronisations_on_real_traces(h100: TraceView, tmp_path) -> None:
    pageable = view_of(H100_PAGEABLE)
    (s,) = Synchronisations().analyze(pageable)
    assert s.evidence["items"] == 60  # .item() 20 times in each of the 3 profiled steps
    assert s.where.endswith("<built-in method item of Tensor> → aten::item")
    assert s.at_stake_ns >= 0.02 * pageable.step_ns
    # Quiet: the profiler's own synchronisation when it stops is outside the steps, and
    # AdamW's .item() on its CPU step counters does not wait for the GPU.
    assert Synchronisations().analyze(view_of(H100_PINNED)) == []
    assert Synchronisations().analyze(h100) == []
    # Hand-made: a long cudaStreamSynchronize under .item() inside a step.
    b = busy_gemm(n=4)
    b.host("ProfilerStep#1", 0, 10_000, cat="user_annotation")
    b.host("aten::item", 3000, 1500)
    b.host("cudaStreamSynchronize", 3100, 1400, cat="cuda_runtime")
    (s,) = Synchronisations().analyze(view_of(b.write(tmp_path / "t.json")))
    assert s.at_stake_ns == 1_400_000 and s.evidence["items"] == 1


def test_data_loader_waits(slow_data_trace: Path, plain_trace: Path) -> None:
    (s,) = DataLoaderWaits().analyze(view_of(slow_data_trace))
    assert s.evidence["batches"] == 3 and "num_workers" in s.advice
    assert "enumerate(DataLoader)" in s.where
    assert DataLoaderWaits().analyze(view_of(plain_trace)) == []


def test_comm_overlap(h100: TraceView, tmp_path) -> None:
    assert CommOverlap().analyze(h100) == []  # one GPU: no communication kernels
    exposed = busy_gemm(n=4)
    exposed.launch("c10d::allreduce_", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 3000, 800,
                   stream=20)
    (s,) = CommOverlap().analyze(view_of(exposed.write(tmp_path / "exposed.json")))
    assert s.at_stake_ns == 800_000
    hidden = busy_gemm(n=4)
    hidden.launch("c10d::allreduce_", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1200, 600,
                  stream=20)
    assert CommOverlap().analyze(view_of(hidden.write(tmp_path / "hidden.json"))) == []


def test_report_is_ordered_by_time_at_stake(h100: TraceView, plain_trace: Path) -> None:
    found = run_all(h100)
    assert [s.analyzer for s in found][:2] == ["idle-gpu", "launch-bound"]
    assert [s.at_stake_ns for s in found] == sorted((s.at_stake_ns for s in found),
                                                    reverse=True)
    assert run_all(view_of(plain_trace)) == []  # a healthy CPU run: nothing to say
