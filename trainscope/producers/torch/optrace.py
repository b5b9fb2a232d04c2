"""The live op trace for what-if analysis (``attach(optrace=True)`` or TRAINSCOPE_OPTRACE=1).

Per step, in the Megatron op-trace model (:mod:`trainscope.schemas.whatif`): forward and
backward compute per micro-batch (each top-level forward/backward), the data-parallel gradient
all-reduce (DDP buckets, as ``separate-grads-all-reduce``) and the optimizer. Pipeline
send/recv are not seen by these hooks (they need the pipeline framework's own timers).
Ops go out every ``FLUSH_STEPS`` steps as :class:`OpTraceBatch` messages on ``OPTRACE_TOPIC``,
the same envelope ``trainscope replay optrace`` publishes.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from trainscope.schemas.topics import OPTRACE_TOPIC
from trainscope.schemas.whatif import (
    OpTraceJob,
    OpTraceRecord,
    encode_records,
)

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

FLUSH_STEPS = 50
COMPUTE = frozenset({"forward-compute", "backward-compute"})


class OpTraceRecorder:
    def __init__(self, att: Attachment) -> None:
        o = att.options
        self.att = att
        self.job = OpTraceJob(job_id=o.job_id, dp_size=o.dp_size, pp_size=o.pp_size,
                              tp_size=o.tp_size, world_size=o.world_size)
        self._lock = threading.Lock()  # DDP all-reduce completions arrive on comm threads
        self._ops: list[tuple[str, int, int]] = []
        self._done: list[OpTraceRecord] = []
        self._steps = 0

    def add(self, optype: str, start_ns: int, end_ns: int) -> None:
        with self._lock:
            self._ops.append((optype, start_ns, end_ns))

    def end_step(self, step: int) -> None:
        o = self.att.options
        with self._lock:
            ops, self._ops = self._ops, []
        ops.sort(key=lambda op: op[1])
        micro = {"forward-compute": 0, "backward-compute": 0}
        for seq_id, (optype, start_ns, end_ns) in enumerate(ops):
            mb_id = -1
            if optype in COMPUTE:
                mb_id = micro[optype]
                micro[optype] += 1
            self._done.append(OpTraceRecord(
                job_id=o.job_id, dp_rank=o.dp_rank, stage=o.pp_stage, rank=o.rank, step=step,
                optype=optype, start_ts=start_ns / 1e9, duration=(end_ns - start_ns) / 1e9,
                seq_id=seq_id, mb_id=mb_id,
            ))
        self._steps += 1
        if self._steps % FLUSH_STEPS == 0:
            self.flush()

    def flush(self) -> None:
        done, self._done = self._done, []
        if not done:
            return
        for _key, payload in encode_records(self.job, done):
            self.att.sender.submit_encoded(OPTRACE_TOPIC, payload, len(done))
