"""The cheap per-step path (issue 24) sends the same records as the exact one it replaced.

After two steps the producer times backward with two persistent parameter hooks instead of a
tensor hook plus an autograd-engine callback every step, and the per-step phases go through
integer logs drained by the sender thread. These tests train a small real model both ways
(the exact way forced by a stand-in decision: the mechanism the earlier producer ran every
step) and compare what reaches the bus, and check the durations against the loop's own clock.
"""

from __future__ import annotations

import statistics
import time
from itertools import pairwise
from typing import Any

import torch
from torch_producer_helpers import read_records, steps_of, summaries_of

from trainscope.producers.torch.backward import EXACT, PARAMETERS
from trainscope.schemas.sketch import merge, quantile
from trainscope.transport.memory import MemoryBus

STEPS = 24
BATCH = 16


def make_model() -> torch.nn.Module:
    # A heavy body and a light head: the settled start (first gradient accumulated, after the
    # head's backward) misses only a small part of backward.
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )


def timed_train(model: torch.nn.Module) -> dict[str, list[int]]:
    """A plain loop that also measures, with its own clock, what the producer should see."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(STEPS * BATCH, 64),
                                          torch.randn(STEPS * BATCH, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    own: dict[str, list[int]] = {"forward": [], "backward": [], "optimizer.step": []}
    for x, y in loader:
        t0 = time.time_ns()
        out = model(x)
        t1 = time.time_ns()
        loss = torch.nn.functional.mse_loss(out, y)
        optimizer.zero_grad()
        t2 = time.time_ns()
        loss.backward()
        t3 = time.time_ns()
        optimizer.step()
        t4 = time.time_ns()
        own["forward"].append(t1 - t0)
        own["backward"].append(t3 - t2)
        own["optimizer.step"].append(t4 - t3)
    return own


def run(attach: Any, bus: MemoryBus, exact: bool) -> tuple[list[Any], dict[str, list[int]], str]:
    att = attach(bus=bus, window_s=60.0)
    if exact:  # stand-in for the calibration's decision: keep the exact mechanism
        timer = att.model_hooks.backward
        timer._decide = lambda tops: (timer.remove_hooks(), setattr(timer, "mode", EXACT))
    own = timed_train(make_model())
    mode = att.model_hooks.backward.mode
    att.detach()
    assert att.stats()["errors"] == 0
    return read_records(bus), own, mode


def totals(records: list[Any]) -> dict[tuple[str, str], tuple[int, int]]:
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for s in summaries_of(records):
        count, total = out.get((s.layer, s.name), (0, 0))
        out[(s.layer, s.name)] = (count + s.count, total + s.total_ns)
    return out


def merged_sketch(records: list[Any], name: str) -> tuple[list[int], list[int]]:
    """The duration sketch of one torch phase over every window the producer sent."""
    keys: list[int] = []
    counts: list[int] = []
    for s in summaries_of(records):
        if (s.layer, s.name) == ("torch_op", name):
            keys, counts = merge(keys, counts, s.sketch_keys, s.sketch_counts)
    return keys, counts


def test_the_settled_path_sends_the_same_functions_steps_and_fields(attach) -> None:
    exact_records, _, exact_mode = run(attach, MemoryBus(), exact=True)
    fast_records, own, fast_mode = run(attach, MemoryBus(), exact=False)
    assert (exact_mode, fast_mode) == (EXACT, PARAMETERS)
    exact, fast = totals(exact_records), totals(fast_records)
    # The same functions (GC pauses come and go with the collector's mood), the same counts.
    phases = {("torch_op", "forward"), ("torch_op", "backward"),
              ("torch_op", "optimizer.step"), ("dataloader", "next_batch")}
    assert phases <= set(fast) and phases <= set(exact)
    assert set(fast) - {("gc", "gc.collect")} == set(exact) - {("gc", "gc.collect")}
    for phase in phases:
        assert fast[phase][0] == exact[phase][0], phase
    assert fast[("torch_op", "backward")][0] == STEPS
    assert fast[("dataloader", "next_batch")][0] == STEPS + 1
    # Step records: the same fields and values but times, tiling the timeline.
    for records in (exact_records, fast_records):
        steps = steps_of(records)
        assert [r.step for r in steps] == list(range(STEPS))
        assert {(r.job_id, r.rank, r.samples, r.tokens) for r in steps} == {
            ("test-job", 0, BATCH, 0)
        }
        assert all(b.start_ns == a.start_ns + a.duration_ns for a, b in pairwise(steps))
    # Durations plausible against the loop's own clock, over the steps the fast path timed
    # (from the third on; the first two are discovery and calibration, timed exactly).
    settled = slice(2, None)
    for name in ("forward", "optimizer.step"):
        _, total = fast[("torch_op", name)]
        assert 0 < total <= sum(own[name]), name
    _, backward_ns = fast[("torch_op", "backward")]
    own_backward = sum(own["backward"])
    assert backward_ns <= own_backward
    # The settled start is the first accumulated gradient (after the loss's and the head's
    # backward): most of a backward whose work is in the body, not all of it. Compared step
    # for step as medians: one preemption of the loop by a busy neighbour on the core can
    # outweigh every settled backward's sub-millisecond work in a sum.
    fast_backward = merged_sketch(fast_records, "backward")
    assert quantile(*fast_backward, 0.5) >= 0.4 * statistics.median(own["backward"][settled])


def test_a_model_with_one_parameter_keeps_the_exact_backward(attach, memory_bus) -> None:
    """First and last gradient are the same tensor: the parameters could not time backward."""
    att = attach()
    model = torch.nn.Linear(16, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        loss = model(torch.randn(4, 16)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert att.model_hooks.backward.mode == EXACT
    att.detach()
    assert totals(read_records(memory_bus))[("torch_op", "backward")][0] == 5


def test_a_pass_that_misses_the_last_parameter_recalibrates(attach, memory_bus) -> None:
    """A step whose backward skips the settled end parameter starts calibration again and
    loses no step; the backward of that step is not counted (it never ended)."""
    att = attach()

    class Skippable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 1)
            self.skip_first = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x if self.skip_first else self.first(x))

    model = Skippable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        loss = model(torch.randn(4, 16)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for _ in range(4):
        step()
    assert att.model_hooks.backward.mode == PARAMETERS
    model.skip_first = True
    step()  # the last-accumulated parameter (in `first`) gets no gradient this step
    assert att.model_hooks.backward.mode != PARAMETERS
    model.skip_first = False
    for _ in range(3):
        step()
    assert att.model_hooks.backward.mode == PARAMETERS
    att.detach()
    assert att.stats()["steps"] == 8 and att.stats()["errors"] == 0
    assert totals(read_records(memory_bus))[("torch_op", "backward")][0] >= 7


def test_the_step_boundary_skips_the_model_hooks_exactly_when_they_have_nothing_to_do(
        attach, monkeypatch) -> None:
    """The step boundary inlines ``ModelHooks.quiet_at_step_end`` to save a call per step: it
    calls ``on_step_end`` at every boundary the reference says has work (discovery,
    calibration, a pass that missed a hook, a step without a forward), and at no other."""
    att = attach()
    hooks = att.model_hooks
    original_end_step, original_on_step_end = att.end_step, hooks.on_step_end
    calls: list[bool] = []
    seen: list[tuple[bool, bool]] = []  # per boundary: (reference says quiet, called)

    def on_step_end() -> None:
        calls.append(True)
        original_on_step_end()

    def end_step(now_ns: int, *args: Any) -> None:
        quiet, before = hooks.quiet_at_step_end(), len(calls)
        original_end_step(now_ns, *args)
        seen.append((quiet, len(calls) > before))

    monkeypatch.setattr(hooks, "on_step_end", on_step_end)
    monkeypatch.setattr(att, "end_step", end_step)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(forward: bool = True) -> None:
        optimizer.zero_grad()
        if forward:
            model(torch.randn(4, 64)).square().mean().backward()
        optimizer.step()

    for _ in range(6):
        step()
    step(forward=False)  # a step without the model's forward: discovery starts over
    for _ in range(6):
        step()
    att.detach()
    assert len(seen) == 13
    assert all(quiet != called for quiet, called in seen), seen
    assert sum(quiet for quiet, _ in seen) >= 6  # the settled steps, on both sides
    assert not seen[6][0]  # the step without a forward was not skipped
