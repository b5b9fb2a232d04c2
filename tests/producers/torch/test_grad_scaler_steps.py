"""Steps the loss scaler skips still end (``trainscope.producers.torch.scaler``).

Mixed-precision training with ``torch.amp.GradScaler``: a step whose scaled gradients hold an
inf is skipped by the scaler, which then never calls ``optimizer.step()``, the step boundary.
Real torch, a real scaler (the CPU one: the skipping is the same on a GPU), gradients made
infinite on purpose every fifth iteration.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch_producer_helpers import read_records, steps_of

ITERATIONS = 20


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


@pytest.mark.parametrize("skip_every", [5, 0], ids=["some-skipped", "none-skipped"])
def test_every_iteration_is_one_step_whether_the_scaler_skipped_it_or_not(
        attach, memory_bus, skip_every: int) -> None:
    att = attach(window_s=0.5)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x = torch.randn(8, 16)
    skipped = 0
    for i in range(ITERATIONS):
        overflow = skip_every and i % skip_every == skip_every - 1
        loss = model(x).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale  # the scale backs off after a skipped step
        optimizer.zero_grad()
        time.sleep(0.005)
    att.detach()
    assert skipped == (ITERATIONS // skip_every if skip_every else 0)
    steps = steps_of(read_records(memory_bus))
    # Before: 16 records for 20 iterations, the four skipped ones merged into the next.
    assert [s.step for s in steps] == list(range(ITERATIONS))
    assert all(s.duration_ns < 100_000_000 for s in steps), [s.duration_ns for s in steps]
