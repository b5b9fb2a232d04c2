"""An op trace as its ranks would have sent it live: topology, step records, function summaries.

A what-if op trace (Megatron timers: one row per op, per worker and step) holds what the
always-on layer measures, so replaying it on the events topic puts a finished job's trace in
front of the online detectors as well as the what-if analysis, and the two answers can be read
side by side.

Timing: a trace samples steps (e.g. 23, 25, 33 …) and times each from 0; the replay lays them
back to back in step order from ``start_ns`` (default: now, less the trace's length, so the
job looks as if it had just run), a step lasting as long as its last op on any worker, as in
synchronous training. Each worker's step record covers that whole step, so the step time is the
trace's own. Every op becomes one span of its worker, filed in the window its *step* started in
(a live rank files a span by its own start): a window then holds the ops of exactly the steps
it counts, and its "ms per step" figures are the trace's own, whatever the window length.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainscope.schemas.optypes import OPTYPES
from trainscope.schemas.recorder import WindowRecorder
from trainscope.schemas.records import StepRecord, Topology, WorkerInfo
from trainscope.schemas.whatif import OpTraceJob

# What the live PyTorch producer calls the same work; every other op type is communication
# (``optimizer-clip-main-grad`` too: its time is mostly the all-reduce of the gradient norm,
# where a fast stage waits for a slow one).
_NAMES: dict[str, tuple[str, str]] = {
    "forward-compute": ("torch_op", "forward"),
    "backward-compute": ("torch_op", "backward"),
    "optimizer": ("torch_op", "optimizer.step"),
    "gc": ("gc", "gc.collect"),
}
LAYER_OF_OPTYPE: dict[str, tuple[str, str]] = {
    name: _NAMES.get(name, ("collective", name)) for name in OPTYPES
}


def trace_length_ns(frame: pd.DataFrame) -> int:
    """The trace's steps laid back to back: how long the replayed job runs."""
    return int(_step_lengths_s(frame).sum() * 1e9)


def online_records(
    job: OpTraceJob, frame: pd.DataFrame, start_ns: int, window_s: float
) -> list[object]:
    """The topology, then per worker its step records and its function summaries.

    ``frame`` is a validated trace (:func:`trainscope.schemas.optrace.load_trace`: an ``op``
    code column); ``window_s`` is the producers' window length (the pipeline's ``--window-s``).
    """
    lengths_s = _step_lengths_s(frame)
    offsets_ns = dict(zip(lengths_s.index, (lengths_s.cumsum() - lengths_s) * 1e9, strict=True))
    topology = Topology(
        job_id=job.job_id, dp_size=job.dp_size, pp_size=job.pp_size, tp_size=job.tp_size,
        workers=[WorkerInfo(rank=int(r), dp_rank=int(d), pp_stage=int(s))
                 for r, d, s in frame[["rank", "dp_rank", "stage"]].drop_duplicates()
                 .sort_values("rank").itertuples(index=False)],
    )
    out: list[object] = [topology]
    step_numbers = {step: i + 1 for i, step in enumerate(lengths_s.index)}
    for rank, rows in frame.groupby("rank", sort=True):
        out.extend(
            StepRecord(job_id=job.job_id, rank=int(rank), step=step_numbers[step],
                       start_ns=start_ns + int(offsets_ns[step]),
                       duration_ns=int(lengths_s[step] * 1e9))
            for step in sorted(rows["step"].unique())
        )
        recorder = WindowRecorder.for_window(window_s)
        for op, step, duration_s in zip(rows["op"].tolist(), rows["step"].tolist(),
                                        rows["duration"].tolist(), strict=True):
            layer, name = LAYER_OF_OPTYPE[OPTYPES[op]]
            # Filed in its step's window, so each window holds whole steps: its per-step
            # figures divide the ops of exactly the steps it counts.
            recorder.add(layer, name, start_ns + int(offsets_ns[step]), int(duration_s * 1e9))
        for window_start, functions in recorder.take_all():
            out.extend(recorder.summaries(job.job_id, int(rank), window_start, functions))
    return out


def _step_lengths_s(frame: pd.DataFrame) -> pd.Series:
    ends = frame["start_ts"].astype(np.float64) + frame["duration"].astype(np.float64)
    return ends.groupby(frame["step"]).max().sort_index()
