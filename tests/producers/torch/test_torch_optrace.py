"""attach(optrace=True): per-step ops in the what-if model, readable by the what-if loader."""

from __future__ import annotations

import torch
from torch_producer_helpers import TinyModel

from trainscope.producers.replay.optrace import to_frame
from trainscope.schemas.optrace import JobMeta, validate
from trainscope.schemas.topics import OPTRACE_TOPIC
from trainscope.schemas.whatif import decode_optrace


def test_the_live_op_trace_has_every_micro_batch_and_the_optimizer(attach, memory_bus) -> None:
    att = attach(optrace=True)
    model = TinyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        optimizer.zero_grad()
        for _ in range(2):  # gradient accumulation: two micro-batches per step
            model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
    att.detach()
    batches = [decode_optrace(m.value)
               for m in memory_bus.consumer([OPTRACE_TOPIC], "c").poll(max_records=100)]
    frame = to_frame(batches).sort_values(["step", "seq_id"])
    for step in range(3):
        ops = frame[frame.step == step]
        assert list(ops.optype) == ["forward-compute", "backward-compute"] * 2 + ["optimizer"]
        assert list(ops.mb_id) == [0, 0, 1, 1, -1]
        assert (ops.duration > 0).all()
        assert ops.start_ts.is_monotonic_increasing
    # The what-if loader accepts it as it is.
    validated = validate(frame, JobMeta(dp_size=1, pp_size=1, world_size=1), "live")
    assert len(validated) == 15
