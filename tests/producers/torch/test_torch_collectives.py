"""torch.distributed collectives and DDP's gradient all-reduce, on a one-process gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch_producer_helpers import TinyModel, read_records, summaries_of, train

from trainscope.schemas.records import FunctionSummary


def _by_name(records: list[object]) -> dict[str, list[FunctionSummary]]:
    out: dict[str, list[FunctionSummary]] = {}
    for s in summaries_of(records):
        out.setdefault(s.name, []).append(s)
    return out


def test_collectives_are_timed_with_op_bytes_and_group(gloo_group, attach, memory_bus) -> None:
    att = attach()
    assert att.options.world_size == 1
    tensor = torch.ones(1000)  # 4000 bytes
    for _ in range(3):
        dist.all_reduce(tensor)
    work = dist.all_reduce(tensor, async_op=True)
    work.wait()
    dist.broadcast(tensor, src=0)
    outputs = [torch.empty(1000)]
    dist.all_gather(outputs, tensor)
    dist.barrier()
    sub = dist.new_group([0])
    dist.all_reduce(tensor, group=sub)
    att.detach()
    names = _by_name(read_records(memory_bus))
    all_reduce = names["all_reduce"]
    assert sum(s.count for s in all_reduce) == 4  # three blocking + one async, on WORLD
    assert sum(s.bytes_total for s in all_reduce) == 4 * 4000
    assert all(s.layer == "collective" for s in all_reduce)
    assert sum(s.bytes_total for s in names["broadcast"]) == 4000
    assert sum(s.bytes_total for s in names["all_gather"]) == 4000
    assert "barrier" in names
    sub_names = [n for n in names if n.startswith("all_reduce[")]
    assert len(sub_names) == 1 and sum(s.count for s in names[sub_names[0]]) == 1


def test_ddp_gradient_all_reduce_is_timed_and_results_are_unchanged(
    gloo_group, attach, memory_bus
) -> None:
    torch.manual_seed(0)
    reference = TinyModel()
    observed = TinyModel()
    observed.load_state_dict(reference.state_dict())
    ddp_reference = torch.nn.parallel.DistributedDataParallel(reference)
    torch.manual_seed(1)
    train(ddp_reference, steps=4)

    att = attach()
    ddp = torch.nn.parallel.DistributedDataParallel(observed)
    torch.manual_seed(1)
    train(ddp, steps=4)
    att.detach()
    for a, b in zip(reference.parameters(), observed.parameters(), strict=True):
        assert torch.equal(a, b)
    names = _by_name(read_records(memory_bus))
    ddp_allreduce = names["ddp_allreduce"]
    assert sum(s.count for s in ddp_allreduce) >= 4  # at least one bucket per step
    grad_bytes = sum(p.numel() * 4 for p in observed.parameters())
    assert sum(s.bytes_total for s in ddp_allreduce) == 4 * grad_bytes
    # DDP's own reduction does not go through dist.all_reduce twice.
    assert "all_reduce" not in names
    # "forward" is the wrapped model's own compute; DDP's work before it is apart.
    assert sum(s.count for s in names["forward"]) == 4
    assert sum(s.count for s in names["ddp_pre_forward"]) == 4
    assert all(s.layer == "collective" for s in names["ddp_pre_forward"])
    assert sum(s.count for s in names["backward"]) == 4


def test_a_model_with_its_own_comm_hook_keeps_it(gloo_group, attach) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    att = attach()
    ddp = torch.nn.parallel.DistributedDataParallel(TinyModel())
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    train(ddp, steps=2)
    assert att.stats()["errors"] == 0 and att.stats()["steps"] == 2
