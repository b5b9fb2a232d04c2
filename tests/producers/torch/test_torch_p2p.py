"""Point-to-point sends under attach(): ``dist.P2POp`` (Megatron's and torch's pipeline
schedules build their sends with it) and ``batch_isend_irecv`` work as without us, in a real
two-process gloo group. Before, ``dist.P2POp(dist.isend, ...)`` raised ValueError ("Invalid
op") into the training script as soon as attach() had hooked ``isend``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # the spawned child's helpers
    from torch_producer_helpers import read_records, summaries_of

    import trainscope
    from trainscope.transport.memory import MemoryBus

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=WORLD)
    bus = MemoryBus()
    handle = trainscope.attach(job_id="p2p", bus=bus, window_s=1.0)
    peer = 1 - rank
    outcome: dict[str, object] = {}
    # As torch.distributed.pipelining's schedules do: build the ops, tell all-send batches
    # from the others by their op, then run them batched.
    sent = torch.full((4,), float(rank))
    received = torch.zeros(4)
    ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, received, peer)]
    if rank == 1:
        ops.reverse()
    outcome["homogeneous_sends"] = {p.op for p in ops[:1] if rank == 0} == {dist.isend}
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    outcome["batched"] = received.tolist()
    # Plain isend/irecv through the hooked module functions: timed.
    if rank == 0:
        dist.isend(torch.full((8,), 7.0), 1).wait()
    else:
        got = torch.zeros(8)
        dist.irecv(got, 0).wait()
        outcome["plain"] = got.tolist()
    dist.barrier()
    handle.detach()
    outcome["errors"] = handle.stats()["errors"]
    outcome["timed"] = sorted({s.name for s in summaries_of(read_records(bus))
                               if s.layer == "collective"})
    Path(out_dir, f"{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def test_p2p_ops_and_batched_sends_work_under_attach(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)),
                       nprocs=WORLD, start_method="spawn")
    outcomes = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    assert outcomes[0]["batched"] == [1.0] * 4 and outcomes[1]["batched"] == [0.0] * 4
    assert outcomes[0]["homogeneous_sends"] is True
    assert outcomes[1]["plain"] == [7.0] * 8
    assert outcomes[0]["errors"] == outcomes[1]["errors"] == 0
    assert "isend" in outcomes[0]["timed"] and "irecv" in outcomes[1]["timed"], outcomes
