"""Training loops that real torch.profiler runs record, for the trace tests.

``profile_rank`` runs one rank of a gloo DDP job under ``torch.profiler`` with
``with_stack=True``, ``record_function`` blocks, a DataLoader and torch's own
``tensorboard_trace_handler`` (files named ``host_pid.ts.pt.trace.json[.gz]``). The rank named
``extra_rank`` also runs an ``extra_work`` block every step whose cost is measured with
``perf_counter_ns`` and written next to the traces: its own work (``ns``) and the whole
``with`` block round it (``outer_ns``). A trace's span of the block lies between the two:
``record_function``'s own entry and exit, inside the span, took up to 0.6 ms a step on a
loaded host, 1.1% of the block.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

EXTRA_S = 0.05
ACTIVE_STEPS = 3


class SlowDataset(torch.utils.data.Dataset):
    """Samples that take ``SLOW_SAMPLE_S`` each to load (decoding, augmentation …)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        time.sleep(SLOW_SAMPLE_S)
        return (torch.full((16,), float(index)),)


SLOW_SAMPLE_S = 0.001


def _loop(prof: torch.profiler.profile, model: torch.nn.Module, extra: bool,
          slow_data: bool = False) -> int:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = SlowDataset() if slow_data else torch.utils.data.TensorDataset(torch.randn(64, 16))
    data = torch.utils.data.DataLoader(dataset, batch_size=8)
    extra_ns = outer_ns = 0
    for step, (batch,) in enumerate(data):
        if step >= 1 + ACTIVE_STEPS:
            break
        with record_function("forward"):
            loss = model(batch).pow(2).mean()
        with record_function("backward"):
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        if extra:
            outer_t0 = time.perf_counter_ns()
            with record_function("extra_work"):
                t0 = time.perf_counter_ns()  # the block's own work, measured inside it
                time.sleep(EXTRA_S)
                t1 = time.perf_counter_ns()
            if step >= 1:  # the first step is the profiler's warm-up, not recorded
                extra_ns += t1 - t0
                outer_ns += time.perf_counter_ns() - outer_t0
        prof.step()
    return extra_ns, outer_ns


def assert_block_time(traced_ns: float, known: dict) -> None:
    """A trace's time for the extra block lies within 1% of what the job measured: its own
    work at least, the whole ``with`` round it at most."""
    low, high = known["ns"] * 0.99, known["outer_ns"] * 1.01
    assert low <= traced_ns <= high, f"{traced_ns:.0f} ns not within [{low:.0f}, {high:.0f}]"


def _model(hidden: int = 32, middle: bool = False) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(16, hidden), torch.nn.ReLU()]
    if middle:
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))


# The single-process runs compute about 50 ms per step, as a real step does: with a step of
# about 2 ms, the in-process DataLoader's own time on a loaded machine (next() under the
# profiler's stack recording, 1.7 ms once) was a third of a healthy run's step, and the
# healthy run was told to load ahead.
SINGLE_HIDDEN = 3072


def profile_rank(rank: int, world: int, port: int, out_dir: str, extra_rank: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=ACTIVE_STEPS, repeat=1)
    handler = torch.profiler.tensorboard_trace_handler(out_dir, use_gzip=rank == 1)
    with torch.profiler.profile(schedule=schedule, with_stack=True,
                                on_trace_ready=handler) as prof:
        extra_ns, outer_ns = _loop(prof, model, rank == extra_rank)
    dist.barrier()
    dist.destroy_process_group()
    if rank == extra_rank:
        (Path(out_dir) / "extra_ns.txt").write_text(json.dumps({"rank": rank, "ns": extra_ns,
                                                                 "outer_ns": outer_ns}))


def profile_single(out_dir: Path, *, handler: bool, slow_data: bool = False) -> Path:
    """One process, no torch.distributed: torch's handler naming or a plain export."""
    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=ACTIVE_STEPS, repeat=1)
    on_ready = torch.profiler.tensorboard_trace_handler(str(out_dir)) if handler else None
    with torch.profiler.profile(schedule=schedule, with_stack=True,
                                on_trace_ready=on_ready) as prof:
        _loop(prof, _model(SINGLE_HIDDEN, middle=True), extra=False, slow_data=slow_data)
    if handler:
        (path,) = out_dir.glob("*.pt.trace.json")
        return path
    path = out_dir / "plain.json"
    prof.export_chrome_trace(str(path))
    return path
