"""The always-on layer: steps, forward/backward/optimizer, data-loader waits, GC, attach/detach."""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import time

import pytest
import torch
from torch_producer_helpers import TinyModel, by_type, read_records, steps_of, summaries_of, train

import trainscope
from trainscope.producers.torch import api
from trainscope.producers.torch.options import resolve
from trainscope.schemas.records import Topology


def test_importing_trainscope_does_not_import_torch() -> None:
    code = "import trainscope, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_attach_is_idempotent_and_detach_removes_every_hook(attach) -> None:
    import torch.distributed as dist
    from torch.utils.data import dataloader

    original_next = dataloader._BaseDataLoaderIter.__next__
    original_all_reduce = dist.all_reduce
    callbacks = len(gc.callbacks)
    att = attach()
    assert trainscope.attach(bus="kafka://127.0.0.1:1") is att  # same process: same handle
    assert dataloader._BaseDataLoaderIter.__next__ is not original_next
    assert dist.all_reduce is not original_all_reduce
    att.detach()
    assert dataloader._BaseDataLoaderIter.__next__ is original_next
    assert dist.all_reduce is original_all_reduce
    assert len(gc.callbacks) == callbacks
    assert api.current() is None
    att.detach()  # twice is fine


def test_a_plain_training_loop_yields_steps_and_function_summaries(attach, memory_bus) -> None:
    att = attach(window_s=0.5)
    steps = 12
    train(TinyModel(), steps=steps, batch=8)
    att.detach()
    records = read_records(memory_bus)
    step_records = steps_of(records)
    assert [r.step for r in step_records] == list(range(steps))
    assert all(r.samples == 8 and r.duration_ns > 0 for r in step_records)
    # Consecutive steps tile the timeline: each starts where the previous ended.
    for a, b in itertools.pairwise(step_records):
        assert b.start_ns == a.start_ns + a.duration_ns
    summaries = summaries_of(records)
    window_ns = 500_000_000
    assert all(s.window_start_ns % window_ns == 0 for s in summaries)
    assert all(s.window_end_ns - s.window_start_ns == window_ns for s in summaries)
    counts: dict[tuple[str, str], int] = {}
    for s in summaries:
        counts[(s.layer, s.name)] = counts.get((s.layer, s.name), 0) + s.count
    assert counts[("torch_op", "forward")] == steps
    assert counts[("torch_op", "backward")] == steps
    assert counts[("torch_op", "optimizer.step")] == steps
    # One next() per batch plus the final one that raises StopIteration.
    assert counts[("dataloader", "next_batch")] == steps + 1
    topology = by_type(records, Topology)
    assert len(topology) == 1 and topology[0].workers[0].rank == 0
    stats = att.stats()
    assert stats["records_sent"] == len(records) and stats["records_dropped"] == 0
    assert stats["errors"] == 0


def test_the_forward_of_submodules_is_not_counted_as_a_model_forward(attach, memory_bus) -> None:
    """Discovery picks the outermost trainable module; after the first step only it is timed."""
    att = attach()
    model = TinyModel()
    train(model, steps=5)
    assert att.model_hooks._top_ids == {id(model)} and not att.model_hooks.global_handles
    att.detach()
    forward = [
        s for s in summaries_of(read_records(memory_bus)) if s.name == "forward"
    ]
    assert sum(s.count for s in forward) == 5


def test_backward_time_is_measured_and_excludes_forward(attach, memory_bus) -> None:
    att = attach()
    model = TinyModel(extra_compute=30)  # forward much heavier than backward of the body
    train(model, steps=6)
    att.detach()
    totals = {
        s.name: s.total_ns
        for s in summaries_of(read_records(memory_bus))
        if s.layer == "torch_op"
    }
    steps = sum(r.duration_ns for r in steps_of(read_records(memory_bus, "b")))
    assert 0 < totals["backward"] < steps
    assert totals["forward"] + totals["backward"] + totals["optimizer.step"] <= steps


class SlowDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return torch.randn(16), torch.randn(1)


def test_data_loader_wait_is_the_time_next_blocks(attach, memory_bus) -> None:
    att = attach()
    loader = torch.utils.data.DataLoader(SlowDataset(16, 0.01), batch_size=4)
    train(TinyModel(), steps=4, loader=loader)
    att.detach()
    waits = [
        s for s in summaries_of(read_records(memory_bus)) if s.layer == "dataloader"
    ]
    batches = sum(s.count for s in waits) - 1  # the last next() only raised StopIteration
    assert batches == 4
    # Four samples per batch, each sleeping 10 ms: at least 40 ms per batch.
    assert sum(s.total_ns for s in waits) >= 4 * 4 * 10_000_000


def test_gc_pauses_are_recorded_once_training_started(attach, memory_bus) -> None:
    """Collections while the script still imports and builds its model are no step's cost
    (in windows without steps they would read as one); from the first step on, each counts."""
    att = attach()
    for _ in range(2):
        gc.collect()  # before any sign of training
    model = TinyModel()
    train(model, steps=1)
    for _ in range(3):
        with trainscope.step():
            gc.collect()
    att.detach()
    pauses = [s for s in summaries_of(read_records(memory_bus)) if s.layer == "gc"]
    assert 3 <= sum(s.count for s in pauses) < 5  # an allocation in training may collect too
    assert all(s.name == "gc.collect" for s in pauses)


def test_explicit_steps_for_loops_without_an_optimizer(attach, memory_bus) -> None:
    att = attach()
    model = TinyModel()
    for i in range(5):
        with trainscope.step(samples=3, tokens=30 + i), torch.no_grad():
            model(torch.randn(3, 16))
    att.detach()
    steps = steps_of(read_records(memory_bus))
    assert [(r.step, r.samples, r.tokens) for r in steps] == [
        (i, 3, 30 + i) for i in range(5)
    ]


def test_step_context_is_a_no_op_when_not_attached() -> None:
    assert api.current() is None
    with trainscope.step(samples=1):
        pass


def test_options_resolve_argument_then_environment_then_default() -> None:
    environ = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "TORCHELASTIC_RUN_ID": "run-42",
        "TRAINSCOPE_WINDOW_S": "2.5",
    }
    o = resolve(environ=environ)
    assert (o.rank, o.world_size, o.local_rank, o.job_id, o.window_s) == (3, 8, 1, "run-42", 2.5)
    assert resolve(environ=environ, window_s=7, job_id="mine").window_s == 7
    assert resolve(environ=environ, job_id="mine").job_id == "mine"
    assert resolve(environ={}).bus_url is None
    layout = resolve(environ={}, rank=5, world_size=8, tp_size=2, pp_size=2)
    assert (layout.tp_rank, layout.dp_rank, layout.pp_stage) == (1, 0, 1)
    with pytest.raises(ValueError, match="TRAINSCOPE_WINDOW_S"):
        resolve(environ={"TRAINSCOPE_WINDOW_S": "soon"})
    with pytest.raises(ValueError, match="outside world_size"):
        resolve(environ={}, rank=4, world_size=4)


def test_disable_switch(monkeypatch) -> None:
    monkeypatch.setenv("TRAINSCOPE_DISABLE", "1")
    assert trainscope.attach() is None
    assert api.current() is None


def test_no_bus_keeps_everything_in_process(caplog) -> None:
    att = api.attach(job_id="nobus")
    try:
        assert att is not None
        train(TinyModel(), steps=3)
        stats = att.stats()
        assert stats["bus"] is None and stats["records_sent"] == 0
        assert stats["steps"] == 3 and stats["spans_recorded"] > 0
        att.detach()
        # The step batch and the summary batch at least: condensed, then discarded.
        assert att.stats()["records_unsent"] >= 2
        assert any("no bus configured" in r.getMessage() for r in caplog.records)
    finally:
        if att is not None:
            att.detach()


class SleepyModel(torch.nn.Module):
    """A forward of about 20 ms, after 15 ms of loop body at the start of each step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return self.body(x)


def test_a_windows_spans_and_step_records_cover_the_same_steps(attach, memory_bus) -> None:
    """With a few steps per window, spans filed by their own start and step records by their
    step's start disagreed at every boundary that fell between a step's start and its forward,
    and "ms per step" swung with it; spans now go to their step's window."""
    window_s = 0.2
    att = attach(window_s=window_s)
    model = SleepyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(40):
        time.sleep(0.015)  # loop body before the forward: part of the step
        loss = model(torch.randn(8, 16)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    att.detach()
    records = read_records(memory_bus)
    window_ns = int(window_s * 1e9)
    steps_in: dict[int, int] = {}
    for r in steps_of(records)[1:]:  # step 0 starts at the first forward
        steps_in[r.start_ns // window_ns * window_ns] = steps_in.get(
            r.start_ns // window_ns * window_ns, 0) + 1
    forward_in: dict[int, tuple[int, int]] = {}
    for s in summaries_of(records):
        if s.name == "forward" and s.layer == "torch_op":
            count, total = forward_in.get(s.window_start_ns, (0, 0))
            forward_in[s.window_start_ns] = (count + s.count, total + s.total_ns)
    first = min(steps_in)
    assert len(steps_in) >= 5
    for window, steps in steps_in.items():
        if window == first:
            continue  # holds step 0's forward too
        count, total_ns = forward_in.get(window, (0, 0))
        assert count == steps, (window, count, steps)
        assert 18e6 <= total_ns / steps <= 40e6, (window, total_ns / steps)
