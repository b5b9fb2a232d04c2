"""Tensor parallelism through DTensor, in a real two-process gloo group: its functional
collectives are timed from their issue to the rank's wait for them, so a rank that waits for a
slow peer shows it. Before, a DTensor job showed no collective at all."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
STEPS = 6
SLOW_RANK = 1
SLOW_S = 0.05


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # the spawned child's helpers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch_producer_helpers import read_records, summaries_of

    import trainscope
    from trainscope.transport.memory import MemoryBus

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD)
    bus = MemoryBus()
    handle = trainscope.attach(job_id="tp", bus=bus, window_s=1.0)
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        if rank == SLOW_RANK:
            time.sleep(SLOW_S)  # outside anything attach() hooks: its peer waits for it
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(float(loss), 6))
    handle.detach()
    reduces = [s for s in summaries_of(read_records(bus))
               if s.layer == "collective" and s.name.startswith("all_reduce")]
    Path(out_dir, f"{rank}.json").write_text(json.dumps({
        "losses": losses, "errors": handle.stats()["errors"],
        "count": sum(s.count for s in reduces), "total_ns": sum(s.total_ns for s in reduces)}))
    dist.destroy_process_group()


def test_dtensor_collectives_are_timed_and_the_waiting_rank_shows_the_wait(
        tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)),
                       nprocs=WORLD, start_method="spawn")
    fast, slow = (json.loads((tmp_path / f"{r}.json").read_text())
                  for r in (1 - SLOW_RANK, SLOW_RANK))
    assert fast["losses"] == slow["losses"]  # the same replicated output on both ranks
    assert fast["errors"] == slow["errors"] == 0
    # RowwiseParallel's output all-reduce, once a forward.
    assert fast["count"] == slow["count"] == STEPS, (fast, slow)
    # The fast rank waits for the slow one in it, most of the sleep each step.
    waited_s = (fast["total_ns"] - slow["total_ns"]) / 1e9
    assert waited_s >= 0.5 * SLOW_S * STEPS, (fast, slow)
