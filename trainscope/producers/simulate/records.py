"""Building the simulated cluster's records: span batches, op-trace rows and step records.

The physics in :mod:`.cluster` decides when each op starts and ends for a whole stage at once;
these collectors turn those arrays into what producers publish, without a Python object per
event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from trainscope.producers.simulate.layout import Layout
from trainscope.schemas.optypes import CODE as OPTYPE_CODE
from trainscope.schemas.optypes import OPTYPES
from trainscope.schemas.records import SpanBatch, StepRecord

if TYPE_CHECKING:
    import pandas as pd

FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("step", "train_step"),
    ("dataloader", "next_batch"),
    ("gc", "gc.collect"),
    ("torch_op", "forward"),
    ("torch_op", "backward"),
    ("torch_op", "optimizer.step"),
    ("collective", "tp_all_reduce"),
    ("collective", "pp_send"),
    ("collective", "pp_recv"),
    ("collective", "dp_all_reduce"),
)
_FN = {name: i for i, (_, name) in enumerate(FUNCTIONS)}
_LAYERS = [layer for layer, _ in FUNCTIONS]
_NAMES = [name for _, name in FUNCTIONS]
_COLLECTIVE_FNS = np.array([i for i, (layer, _) in enumerate(FUNCTIONS) if layer == "collective"])


class SpanEmitter:
    """Collects span columns of one step as arrays, one append per op for a whole stage."""

    def __init__(self) -> None:
        self.fn: list[np.ndarray] = []
        self.rank: list[np.ndarray] = []
        self.start: list[np.ndarray] = []
        self.duration: list[np.ndarray] = []
        self.bytes: list[np.ndarray] = []

    def add(
        self, fn: str, ranks: np.ndarray, start: np.ndarray, duration: np.ndarray, nbytes: int = 0
    ) -> None:
        ranks = ranks.ravel()
        if ranks.size == 0:
            return
        self.fn.append(np.full(ranks.size, _FN[fn], dtype=np.int32))
        self.rank.append(ranks)
        self.start.append(np.broadcast_to(start, duration.shape).ravel())
        self.duration.append(duration.ravel())
        self.bytes.append(np.full(ranks.size, nbytes, dtype=np.int64))

    def collective_ns(self, world_size: int) -> np.ndarray:
        """Each rank's time in collectives and point-to-point calls so far (its step record's
        ``collective_ns``)."""
        if not self.fn:
            return np.zeros(world_size)
        fn = np.concatenate(self.fn)
        keep = np.isin(fn, _COLLECTIVE_FNS)
        return np.bincount(np.concatenate(self.rank)[keep],
                           weights=np.concatenate(self.duration)[keep], minlength=world_size)

    def batches(self, job_id: str, layout: Layout, step: int) -> list[SpanBatch]:
        """One SpanBatch per host, as each host's producer would publish the step."""
        emit = self
        rank = np.concatenate(emit.rank)
        host = rank // layout.gpus_per_host
        order = np.argsort(host, kind="stable")
        cols = {
            "rank": rank[order],
            "fn": np.concatenate(emit.fn)[order],
            "start_ns": np.rint(np.concatenate(emit.start)[order]).astype(np.int64),
            "duration_ns": np.rint(np.concatenate(emit.duration)[order]).astype(np.int64),
            "bytes_moved": np.concatenate(emit.bytes)[order],
        }
        bounds = np.flatnonzero(np.diff(host[order])) + 1
        batches = []
        for chunk in np.split(np.arange(len(order)), bounds):
            first_rank = int(cols["rank"][chunk[0]])
            batches.append(
                SpanBatch.from_arrays(
                    job_id=job_id,
                    host=layout.host(first_rank),
                    layers=_LAYERS,
                    names=_NAMES,
                    step=np.full(len(chunk), step),
                    **{k: v[chunk] for k, v in cols.items()},
                )
            )
        return batches


class OpRecorder:
    """Op-trace rows of one step in the Megatron timer model, one append per op for all DP ranks
    of a stage.

    One worker is one (dp_rank, stage) pair seen from its tp_rank 0: the tensor-parallel peers
    are inside each op, so a compute op lasts until its TP all-reduce is done, as a Megatron
    timer around the layer's forward/backward records it.
    """

    def __init__(self, dp: int, tp: int) -> None:
        self.dp, self.tp = dp, tp
        self.stage: list[int] = []
        self.code: list[int] = []
        self.seq: list[int] = []
        self.mb: list[int] = []
        self.start: list[np.ndarray] = []  # (dp,) ns each
        self.end: list[np.ndarray] = []
        self._next_seq: dict[tuple[int, int], int] = {}

    def add(
        self, optype: str, stage: int, start: np.ndarray, end: np.ndarray, mb: int = -1
    ) -> None:
        """``start``/``end``: (dp, tp) or (dp,) arrays of ns; only tp_rank 0 is kept."""
        code = OPTYPE_CODE[optype]
        # Ops of a stage are simulated in schedule order, which is each worker's start order.
        key = (stage, code)
        seq = self._next_seq.get(key, 0)
        self._next_seq[key] = seq + 1
        self.stage.append(stage)
        self.code.append(code)
        self.seq.append(seq)
        self.mb.append(mb)
        self.start.append(start[:, 0] if start.ndim == 2 else start)
        self.end.append(end[:, 0] if end.ndim == 2 else end)

    def frame(self, step: int) -> pd.DataFrame:
        import pandas as pd

        dp, tp = self.dp, self.tp
        n_ops = len(self.code)

        def per_op(values: list[int]) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=np.int32), dp)

        start = np.stack(self.start)
        stage = per_op(self.stage)
        dp_rank = np.tile(np.arange(dp, dtype=np.int32), n_ops)
        mb = per_op(self.mb)
        return pd.DataFrame(
            {
                "dp_rank": dp_rank,
                "stage": stage,
                "rank": (dp_rank.astype(np.int64) + dp * stage) * tp,  # tp_rank 0
                "step": np.full(n_ops * dp, step, dtype=np.int64),
                "optype": pd.Categorical.from_codes(per_op(self.code), list(OPTYPES)),
                "start_ts": start.ravel() / 1e9,
                # Subtract in ns first: seconds near the epoch keep only ~0.2 µs.
                "duration": (np.stack(self.end) - start).ravel() / 1e9,
                "seq_id": per_op(self.seq),
                "mc": np.zeros(n_ops * dp, dtype=np.int32),  # no virtual stages: vpp_size 1
                "gmc": stage,
                "mb_id": pd.arrays.IntegerArray(np.maximum(mb, 0), mb < 0),
            }
        )


def step_records(
    job_id: str,
    layout: Layout,
    microbatches: int,
    step: int,
    start: np.ndarray,
    end: np.ndarray,
    tokens: np.ndarray | None,
    collective_ns: np.ndarray | None = None,
) -> list[StepRecord]:
    """One StepRecord per rank; ``tokens`` is (dp replica, micro-batch), None: not sent;
    ``collective_ns`` per rank, None: not timed."""
    records = []
    for rank in range(layout.world_size):
        dp_rank, _, _ = layout.coords(rank)
        seq = tokens[dp_rank] if tokens is not None else None
        records.append(
            StepRecord(
                job_id=job_id,
                rank=rank,
                step=step,
                start_ns=int(start[rank]),
                duration_ns=int(end[rank] - start[rank]),
                samples=microbatches,
                tokens=int(seq.sum()) if seq is not None else 0,
                seq_len_mean=float(seq.mean()) if seq is not None else 0.0,
                seq_len_max=int(seq.max()) if seq is not None else 0,
                collective_ns=int(collective_ns[rank]) if collective_ns is not None else 0,
            )
        )
    return records

