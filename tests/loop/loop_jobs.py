"""One rank of a gloo DDP job on CPU with ``trainscope.attach()``, for the closed-loop tests.

The rank named ``extra_rank`` runs an ``extra_work`` ``record_function`` block inside its
forward every step; the block's cost is measured inside it (``perf_counter_ns``) with the time
it started, so the test can take its mean over exactly the steps a profile covered. Rank 0
decides when every rank stops: when the file ``stop_file`` exists (the test saw the loop
close) or after ``max_s`` seconds.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import record_function

BATCH = 16
# 50 ms a step: on a busy 2-core test host a rank descheduled in one backward pass can add
# 30 ms a step to it over a 5-step profile (a CI run saw the largest delta land there).
EXTRA_S = 0.05


class Net(torch.nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
        )
        self.extra = extra
        self.extra_blocks: list[tuple[int, int]] = []  # (start time ns, cost ns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra:
            with record_function("extra_work"):
                started_ns = time.time_ns()
                t0 = time.perf_counter_ns()
                time.sleep(EXTRA_S)  # the straggler's own, extra work
                self.extra_blocks.append((started_ns, time.perf_counter_ns() - t0))
        return self.body(x)


def run_rank(rank: int, world: int, port: int, bus_url: str, job_id: str, extra_rank: int,
             stop_file: str, max_s: float, result: Connection) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import trainscope

    handle = trainscope.attach(bus=bus_url, job_id=job_id, window_s=2.0)
    assert handle is not None
    net = Net(extra=rank == extra_rank)
    model = torch.nn.parallel.DistributedDataParallel(net)
    data = torch.utils.data.TensorDataset(torch.randn(1 << 16, 64), torch.randn(1 << 16, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    stop = torch.zeros(1)
    started = time.monotonic()
    step = 0
    while not stop.item():
        for x, y in loader:
            step += 1
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 0:
                done = time.monotonic() - started > max_s or Path(stop_file).exists()
                stop.fill_(float(rank == 0 and done))
                dist.broadcast(stop, src=0)
                if stop.item():
                    break
    handle.detach()
    reports = [(r.request_id, r.started_ns, r.stopped_ns, r.steps_profiled)
               for r in handle.profiler.reports]
    result.send({"rank": rank, "stats": handle.stats(), "reports": reports,
                 "extra_blocks": net.extra_blocks, "steps": step})
    dist.destroy_process_group()
