"""Turn the op rows of a trace into dense arrays indexed by (op position, step, DP rank).

Every worker of one pipeline stage runs the same schedule, so the ops of a stage form a
*template* (one entry per ``(optype, seq_id)``, in the order the workers ran them). Stacking the
templates of all stages gives the node list of the dependency graph; each node's start and
duration over all steps and DP ranks is one ``(steps, dp_size)`` slice of a 3-D array, which is
what lets the simulator replay every step and rank at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from trainscope.whatif.optypes import OPTIMIZER, OPTYPES
from trainscope.whatif.trace import JobMeta, TraceError


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

    def describe(self, node: int) -> str:
        return (
            f"{OPTYPES[self.node_op[node]]} #{self.node_seq[node]} on stage {self.node_stage[node]}"
        )


def build_layout(df: pd.DataFrame, meta: JobMeta, source: str = "trace") -> Layout:
    """Build the arrays from a frame normalised by :func:`trace.validate`."""
    dp_size, pp_size = meta.dp_size, meta.pp_size
    stage = df["stage"].to_numpy(np.int64)
    dp = df["dp_rank"].to_numpy(np.int64)
    op = df["op"].to_numpy(np.int64)
    seq = df["seq_id"].to_numpy(np.int64)
    start = df["start_ts"].to_numpy(np.float64)
    step_ids, step_idx = np.unique(df["step"].to_numpy(), return_inverse=True)
    n_steps = len(step_ids)

    seq_span = int(seq.max()) + 1
    if seq.min() < 0:
        raise TraceError(f"{source}: negative seq_id {int(seq.min())}")
    raw_key = (stage * len(OPTYPES) + op) * seq_span + seq
    keys, first_row, key_idx = np.unique(raw_key, return_index=True, return_inverse=True)
    n_keys = len(keys)
    inst = (step_idx * pp_size + stage) * dp_size + dp

    _check_duplicates(inst, key_idx, n_keys, step_ids, pp_size, dp_size, keys, seq_span, source)

    # Template order: the mean position of each op within its worker's step, so one odd
    # instance with reordered ops does not change the schedule of the whole stage.
    order = np.lexsort((start, inst))
    inst_sorted = inst[order]
    boundaries = np.flatnonzero(np.diff(inst_sorted)) + 1
    run_starts = np.concatenate(([0], boundaries))
    run_lengths = np.diff(np.concatenate((run_starts, [len(inst_sorted)])))
    position = np.empty(len(inst), dtype=np.float64)
    position[order] = np.arange(len(inst)) - np.repeat(run_starts, run_lengths)
    mean_pos = np.bincount(key_idx, weights=position, minlength=n_keys) / np.bincount(
        key_idx, minlength=n_keys
    )
    key_stage = stage[first_row]
    node_order = np.lexsort((keys, mean_pos, key_stage))
    node_of_key = np.empty(n_keys, dtype=np.int64)
    node_of_key[node_order] = np.arange(n_keys)
    stage_offsets = np.searchsorted(key_stage[node_order], np.arange(pp_size + 1))

    template_len = np.diff(stage_offsets)
    counts = np.bincount(inst, minlength=n_steps * pp_size * dp_size).reshape(
        n_steps, pp_size, dp_size
    )
    complete = counts == template_len[None, :, None]
    bad_steps = np.flatnonzero(~complete.all(axis=(1, 2)))
    warnings = [
        _drop_message(int(s), step_ids, complete, inst, op, counts, template_len) for s in bad_steps
    ]
    dropped = [int(step_ids[s]) for s in bad_steps]
    if len(bad_steps) == n_steps:
        raise TraceError(f"{source}: no complete step to analyse ({warnings[0]})")

    keep_step = np.ones(n_steps, dtype=bool)
    keep_step[bad_steps] = False
    new_step = np.cumsum(keep_step) - 1
    rows = keep_step[step_idx]
    n_kept = int(keep_step.sum())
    node = node_of_key[key_idx[rows]]
    s_idx = new_step[step_idx[rows]]
    d_idx = dp[rows]
    shape = (n_keys, n_kept, dp_size)
    start_abs = np.empty(shape, dtype=np.float64)
    start_abs[node, s_idx, d_idx] = start[rows]
    duration = np.empty(shape, dtype=np.float64)
    duration[node, s_idx, d_idx] = df["duration"].to_numpy(np.float64)[rows]
    origin = start_abs.min(axis=(0, 2))
    start_abs -= origin[None, :, None]

    picked = first_row[node_order]
    return Layout(
        meta=meta,
        step_ids=step_ids[keep_step],
        node_stage=key_stage[node_order],
        node_op=op[picked],
        node_seq=seq[picked],
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


def _check_duplicates(inst, key_idx, n_keys, step_ids, pp_size, dp_size, keys, seq_span, source):
    combo = inst * n_keys + key_idx
    combo.sort()
    dup = np.flatnonzero(np.diff(combo) == 0)
    if len(dup) == 0:
        return
    value = combo[dup[0]]
    instance, key = divmod(int(value), n_keys)
    step, rest = divmod(instance, pp_size * dp_size)
    stage, dp = divmod(rest, dp_size)
    op_code, seq = divmod(int(keys[key]) % (len(OPTYPES) * seq_span), seq_span)
    raise TraceError(
        f"{source}: step {int(step_ids[step])}: worker (dp_rank {dp}, stage {stage}) has "
        f"{OPTYPES[op_code]} seq_id {seq} more than once"
    )


def _drop_message(s, step_ids, complete, inst, op, counts, template_len) -> str:
    pp_size, dp_size = complete.shape[1:]
    stage, dp = (int(x[0]) for x in np.nonzero(~complete[s]))
    instance = (s * pp_size + stage) * dp_size + dp
    has_optimizer = bool(np.any(op[inst == instance] == OPTIMIZER))
    worker = f"worker (dp_rank {dp}, stage {stage})"
    if not has_optimizer:
        what = f"{worker} has no optimizer op"
    else:
        what = f"{worker} has {counts[s, stage, dp]} ops where its stage's schedule has " + str(
            template_len[stage]
        )
    return f"step {int(step_ids[s])}: {what}; step dropped"
