"""Helpers shared by the PyTorch producer tests."""

from __future__ import annotations

from typing import Any

import torch

from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import FunctionSummary, StepBatch, StepRecord, SummaryBatch
from trainscope.transport.bus import EVENTS_TOPIC
from trainscope.transport.memory import MemoryBus


def read_records(bus: MemoryBus, group: str = "reader") -> list[Any]:
    consumer = bus.consumer([EVENTS_TOPIC], group)
    records: list[Any] = []
    while True:
        messages = consumer.poll(max_records=10_000, timeout_s=0.01)
        if not messages:
            return records
        for message in messages:
            records.extend(decode_batch(message.value))


class TinyModel(torch.nn.Module):
    def __init__(self, extra_compute: int = 0) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.extra_compute = extra_compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.extra_compute):
            x = x + 0.0 * torch.tanh(x @ torch.ones(16, 16))
        return self.body(x)


def train(model: torch.nn.Module, steps: int, batch: int = 8, loader: Any = None) -> None:
    """A plain loop: the script knows nothing about trainscope."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if loader is None:
        data = torch.utils.data.TensorDataset(torch.randn(steps * batch, 16),
                                              torch.randn(steps * batch, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=batch)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def by_type(records: list[Any], kind: type) -> list[Any]:
    return [r for r in records if isinstance(r, kind)]


def summaries_of(records: list[Any]) -> list[FunctionSummary]:
    """The rows of the summary batches the producer sent; it sends no row summaries."""
    assert not by_type(records, FunctionSummary), "the producer sent row summaries"
    return [s for batch in by_type(records, SummaryBatch) for s in batch.to_summaries()]


def steps_of(records: list[Any]) -> list[StepRecord]:
    """The rows of the step batches the producer sent; it sends no row step records."""
    assert not by_type(records, StepRecord), "the producer sent row step records"
    return [s for batch in by_type(records, StepBatch) for s in batch.to_records()]
