"""Turn the op rows of a trace into dense arrays indexed by (op position, step, DP rank).

Every worker of one pipeline stage runs the same schedule, so the ops of a stage form a
*template* (one entry per ``(optype, seq_id)``, in the order DP rank 0 ran them in the first
analysed step). Stacking the
templates of all stages gives the node list of the dependency graph; each node's start and
duration over all steps and DP ranks is one ``(steps, dp_size)`` slice of a 3-D array, which is
what lets the simulator replay every step and rank at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainscope.schemas.optrace import JobMeta, TraceError
from trainscope.schemas.optypes import OPTIMIZER, OPTYPES
from trainscope.whatif.graph import Template


@dataclass
class Layout:
    meta: JobMeta
    step_ids: np.ndarray  # (steps,) the trace's step numbers, ascending
    node_stage: np.ndarray  # (nodes,) pipeline stage of each template op
    node_op: np.ndarray  # (nodes,) optype code
    node_seq: np.ndarray  # (nodes,) seq_id within (worker, step, optype)
    node_mc: np.ndarray
    node_gmc: np.ndarray
    node_mb: np.ndarray  # micro-batch id, -1 where the trace has none
    stage_offsets: np.ndarray  # (pp_size + 1,) nodes of stage s are offsets[s]:offsets[s+1]
    start_s: np.ndarray  # (nodes, steps, dp) seconds since the step's first start
    duration_s: np.ndarray  # (nodes, steps, dp) observed durations
    step_origin_s: np.ndarray  # (steps,) absolute time of each step's first start
    dropped_steps: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        return len(self.node_op)

    def template(self) -> Template:
        """The dependency model's input: DP rank 0 in the first analysed step."""
        start = self.start_s[:, 0, 0]
        return Template(
            stage=self.node_stage,
            op=self.node_op,
            seq=self.node_seq,
            mc=self.node_mc,
            start_s=start,
            end_s=start + self.duration_s[:, 0, 0],
            pp_size=self.meta.pp_size,
            vpp_size=self.meta.vpp_size,
            data_parallel=self.meta.dp_size * self.meta.dsp_size > 1,
        )

    def describe(self, node: int) -> str:
        return (
            f"{OPTYPES[self.node_op[node]]} #{self.node_seq[node]} on stage {self.node_stage[node]}"
        )


def build_layout(df: pd.DataFrame, meta: JobMeta, source: str = "trace") -> Layout:
    """Build the arrays from a frame normalised by :func:`optrace.validate`."""
    dp_size, pp_size = meta.dp_size, meta.pp_size
    stage = df["stage"].to_numpy(np.int64)
    dp = df["dp_rank"].to_numpy(np.int64)
    op = df["op"].to_numpy(np.int64)
    seq = df["seq_id"].to_numpy(np.int64)
    if seq.min() < 0:
        raise TraceError(f"{source}: negative seq_id {int(seq.min())}")
    # Hash-based factorising: sorting tens of millions of rows would dominate the analysis.
    step_codes, step_values = pd.factorize(df["step"].to_numpy(np.int64), sort=True)
    step_ids = np.asarray(step_values, dtype=np.int64)
    n_steps = len(step_ids)
    seq_span = int(seq.max()) + 1
    key_idx, keys = pd.factorize((stage * len(OPTYPES) + op) * seq_span + seq)
    keys = np.asarray(keys, dtype=np.int64)
    n_keys = len(keys)
    # factorize numbers keys in order of first appearance: a key's first row is where the
    # running maximum of the codes first reaches it.
    running = np.maximum.accumulate(key_idx)
    first_row = np.flatnonzero(np.diff(running, prepend=-1) > 0)
    key_stage = stage[first_row]
    key_op = op[first_row]

    flat = (key_idx * n_steps + step_codes) * dp_size + dp
    counts = np.bincount(flat, minlength=n_keys * n_steps * dp_size)
    if counts.max() > 1:
        _raise_duplicate(int(np.argmax(counts)), keys, step_ids, n_steps, dp_size, seq_span, source)
    present = counts.reshape(n_keys, n_steps, dp_size).astype(bool)
    del counts
    complete = np.ones((n_steps, pp_size, dp_size), dtype=bool)
    for s in range(pp_size):
        complete[:, s, :] = present[key_stage == s].all(axis=0)
    bad_steps = np.flatnonzero(~complete.all(axis=(1, 2)))
    warnings = [
        _drop_message(int(b), step_ids, complete, present, key_stage, key_op) for b in bad_steps
    ]
    dropped = [int(step_ids[b]) for b in bad_steps]
    if len(bad_steps) == n_steps:
        raise TraceError(f"{source}: no complete step to analyse ({warnings[0]})")
    keep = np.ones(n_steps, dtype=bool)
    keep[bad_steps] = False

    def dense(column: str) -> np.ndarray:
        out = np.empty(n_keys * n_steps * dp_size, dtype=np.float64)
        out[flat] = df[column].to_numpy(np.float64)
        return out.reshape(n_keys, n_steps, dp_size)[:, keep, :]

    start_k = dense("start_ts")
    # Template order: start order on DP rank 0 in the first analysed step (the step the
    # dependency model is built from); ties by op identity, so row order never matters.
    seq_k = seq[first_row]
    node_order = np.lexsort((seq_k, key_op, start_k[:, 0, 0], key_stage))
    stage_offsets = np.searchsorted(key_stage[node_order], np.arange(pp_size + 1))
    start_abs = start_k[node_order]
    del start_k
    duration = dense("duration")[node_order]
    origin = start_abs.min(axis=(0, 2))
    start_abs -= origin[None, :, None]

    picked = first_row[node_order]
    return Layout(
        meta=meta,
        step_ids=step_ids[keep],
        node_stage=key_stage[node_order],
        node_op=key_op[node_order],
        node_seq=seq_k[node_order],
        node_mc=df["mc"].to_numpy(np.int64)[picked],
        node_gmc=df["gmc"].to_numpy(np.int64)[picked],
        node_mb=df["mb_id"].to_numpy(np.int64)[picked],
        stage_offsets=stage_offsets,
        start_s=start_abs,
        duration_s=duration,
        step_origin_s=origin,
        dropped_steps=dropped,
        warnings=warnings,
    )


def _raise_duplicate(index, keys, step_ids, n_steps, dp_size, seq_span, source):
    key, rest = divmod(index, n_steps * dp_size)
    step, dp = divmod(rest, dp_size)
    stage, rest = divmod(int(keys[key]), len(OPTYPES) * seq_span)
    op_code, seq = divmod(rest, seq_span)
    raise TraceError(
        f"{source}: step {int(step_ids[step])}: worker (dp_rank {dp}, stage {stage}) has "
        f"{OPTYPES[op_code]} seq_id {seq} more than once"
    )


def _drop_message(b, step_ids, complete, present, key_stage, key_op) -> str:
    stage, dp = (int(x[0]) for x in np.nonzero(~complete[b]))
    mine = key_stage == stage
    has = present[mine, b, dp]
    worker = f"worker (dp_rank {dp}, stage {stage})"
    if not has[key_op[mine] == OPTIMIZER].any():
        what = f"{worker} has no optimizer op"
    else:
        what = f"{worker} has {int(has.sum())} ops where its stage's schedule has {len(has)}"
    return f"step {int(step_ids[b])}: {what}; step dropped"
