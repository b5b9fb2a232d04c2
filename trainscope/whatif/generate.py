"""Synthetic Megatron-style op traces: 1F1B pipeline schedules (optionally interleaved), with
knobs to make workers, stages or single ops slow.

Like real Megatron traces they hold batched "send forward, receive backward" calls (a send and
a recv with the same start and duration), never-launched p2p ops, a gc pause, and the
post-backward chain of gradient all-reduces, clip and optimizer.

The generator draws every op's compute or transfer duration and launch delay, then replays the
dependency model to obtain start times, so observed durations of communication ops include
waiting for peers exactly as a real trace's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from trainscope.schemas import optypes as ot
from trainscope.whatif.schedule import host_graph, stage_schedule
from trainscope.whatif.simulate import simulate

# Typical durations in seconds of one op (compute) or of its transfer (communication).
BASE_DURATION_S: dict[str, float] = {
    "forward-compute": 0.004,
    "backward-compute": 0.008,
    "forward-send": 0.0002,
    "forward-recv": 0.0004,
    "backward-send": 0.0002,
    "backward-recv": 0.0004,
    "params-all-gather": 0.002,
    "grads-reduce-scatter": 0.003,
    "separate-grads-all-reduce": 0.004,
    "layernorm-grads-all-reduce": 0.0002,
    "embedding-grads-all-reduce": 0.001,
    "optimizer-clip-main-grad": 0.0003,
    "optimizer": 0.002,
    "gc": 0.00001,
}
# Never-launched p2p ops return at once: this share of their type's duration.
NOOP_SHARE = 0.05


@dataclass(frozen=True)
class Injection:
    """Extra seconds added to matching ops: to their duration, or (``delay``) before their start.

    ``None`` for a coordinate means "every"; ``step`` is the trace's step number.
    """

    optype: str
    extra_s: float
    dp_rank: int | None = None
    stage: int | None = None
    step: int | None = None
    seq_id: int | None = None
    delay: bool = False


@dataclass(frozen=True)
class JobSpec:
    dp_size: int = 4
    pp_size: int = 4
    vpp_size: int = 1
    tp_size: int = 1
    dsp_size: int = 1
    microbatches: int = 8
    steps: int | Sequence[int] = 10  # a count, or the (sampled) step numbers
    distributed_optimizer: bool = True  # params all-gather + grads reduce-scatter, else all-reduce
    overlap_grad_reduce: bool = False  # reduce-scatter per chunk after its backward + all-reduce
    noop_p2p: bool = True  # record never-launched p2p ops, as the Megatron profiler does
    gc: bool = True  # a host-side gc pause after the last backward compute
    noise: float = 0.01  # lognormal sigma of durations
    launch_jitter_s: float = 20e-6  # mean of the exponential launch delay of every op
    step_start_jitter_s: float = 200e-6  # spread of the workers' first starts
    worker_factor: dict[tuple[int, int], float] = field(default_factory=dict)  # (dp, stage)
    stage_factor: dict[int, float] = field(default_factory=dict)  # compute multiplier
    injections: tuple[Injection, ...] = ()
    seed: int = 0
    start_time_s: float = 1.7e9

    @property
    def step_ids(self) -> np.ndarray:
        if isinstance(self.steps, int):
            return np.arange(self.steps)
        return np.asarray(sorted(self.steps), dtype=np.int64)

    def meta(self) -> dict[str, int]:
        sizes = dict(
            dp_size=self.dp_size,
            pp_size=self.pp_size,
            tp_size=self.tp_size,
            dsp_size=self.dsp_size,
            vpp_size=self.vpp_size,
        )
        return {**sizes, "world_size": self.dp_size * self.pp_size * self.tp_size * self.dsp_size}


def generate(spec: JobSpec) -> tuple[pd.DataFrame, dict[str, int]]:
    """Return the op trace (one row per op) and the job metadata."""
    rng = np.random.default_rng(spec.seed)
    schedules = [stage_schedule(spec, s) for s in range(spec.pp_size)]
    flat = [(s, op) for s, sched in enumerate(schedules) for op in sched]
    node_stage = np.array([s for s, _ in flat])
    node_op = np.array([op.code for _, op in flat])
    node_mc = np.array([op.chunk for _, op in flat])
    node_mb = np.array([op.mb for _, op in flat])
    node_gmc = np.where(node_mc >= 0, node_mc * spec.pp_size + node_stage, -1)
    node_seq = np.zeros(len(flat), dtype=np.int64)
    seen: dict[tuple[int, int], int] = {}
    for n, (s, op) in enumerate(flat):
        node_seq[n] = seen.get((s, op.code), 0)
        seen[(s, op.code)] = node_seq[n] + 1
    graph, units = host_graph(spec, schedules, node_stage, node_op, node_seq, node_mc)

    step_ids = spec.step_ids
    shape = (len(flat), len(step_ids), spec.dp_size)
    base = np.array([BASE_DURATION_S[name] for name in ot.OPTYPES])[node_op]
    base[graph.noop] *= NOOP_SHARE
    effective = base[:, None, None] * rng.lognormal(0.0, spec.noise, size=shape)
    compute = np.isin(node_op, list(ot.COMPUTE))[:, None, None]
    factor = np.ones((spec.pp_size, spec.dp_size))
    for s, f in spec.stage_factor.items():
        factor[s, :] *= f
    for (d, s), f in spec.worker_factor.items():
        factor[s, d] *= f
    effective = np.where(compute, effective * factor[node_stage][:, None, :], effective)
    delay = rng.exponential(spec.launch_jitter_s, size=shape)
    firsts = [n for unit in units if not graph.deps[unit[0]] for n in unit]
    delay[firsts] = rng.uniform(0.0, spec.step_start_jitter_s, size=(len(firsts), *shape[1:]))
    for inj in spec.injections:
        target = delay if inj.delay else effective
        sel = _select(inj, node_op, node_stage, node_seq, step_ids, spec.dp_size)
        target[sel] += inj.extra_s
    # A batched call starts once and returns once: its ops share delay and transfer time.
    for unit in units:
        if len(unit) > 1:
            delay[unit] = delay[unit[0]]
            effective[unit] = effective[unit].max(axis=0)
    replay = simulate(graph, effective, shape[1:], delay, keep_times=True)
    assert replay.start_s is not None and replay.end_s is not None
    start = replay.start_s - replay.start_s.min(axis=(0, 2), keepdims=True)
    duration = replay.end_s - replay.start_s
    period = float(replay.step_time_s.max()) * 1.2
    return _frame(
        spec,
        start,
        duration,
        step_ids,
        period,
        node_stage,
        node_op,
        node_seq,
        node_mc,
        node_gmc,
        node_mb,
    ), spec.meta()


def _select(inj, node_op, node_stage, node_seq, step_ids, dp_size):
    nodes = node_op == ot.CODE[inj.optype]
    if inj.stage is not None:
        nodes &= node_stage == inj.stage
    if inj.seq_id is not None:
        nodes &= node_seq == inj.seq_id
    steps = np.ones(len(step_ids), bool) if inj.step is None else step_ids == inj.step
    dps = np.ones(dp_size, bool) if inj.dp_rank is None else np.arange(dp_size) == inj.dp_rank
    return np.ix_(nodes, steps, dps)


def _frame(
    spec,
    start,
    duration,
    step_ids,
    period,
    node_stage,
    node_op,
    node_seq,
    node_mc,
    node_gmc,
    node_mb,
) -> pd.DataFrame:
    dp_size = start.shape[2]

    def per_node(values: np.ndarray, dtype: str) -> np.ndarray:
        return np.broadcast_to(values[:, None, None], start.shape).ravel().astype(dtype)

    dp = np.broadcast_to(np.arange(dp_size)[None, None, :], start.shape).ravel()
    stage = per_node(node_stage, "int32")
    step = np.broadcast_to(step_ids[None, :, None], start.shape).ravel()
    origin = spec.start_time_s + step_ids * period
    is_compute = np.isin(node_op, list(ot.COMPUTE)) & (node_mb >= 0)
    mb = per_node(np.where(is_compute, node_mb, 0), "int32")
    mb_mask = ~per_node(is_compute, "bool")
    return pd.DataFrame(
        {
            "dp_rank": dp.astype("int32"),
            "stage": stage,
            "rank": ((stage.astype(np.int64) * dp_size + dp) * spec.dsp_size) * spec.tp_size,
            "step": step.astype("int64"),
            "optype": pd.Categorical.from_codes(per_node(node_op, "int8"), list(ot.OPTYPES)),
            "start_ts": (start + origin[None, :, None]).ravel(),
            "duration": duration.ravel(),
            "seq_id": per_node(node_seq, "int32"),
            "mc": per_node(np.maximum(node_mc, 0), "int32"),
            "gmc": per_node(np.where(node_gmc >= 0, node_gmc, node_stage), "int32"),
            "mb_id": pd.arrays.IntegerArray(mb, mb_mask),
        }
    )


def write(
    df: pd.DataFrame, meta: dict[str, int], trace_path: str | Path, meta_path: str | Path
) -> None:
    """Write the trace (Parquet or CSV by suffix) and its YAML metadata."""
    import yaml

    trace_path = Path(trace_path)
    if trace_path.suffix.lower() == ".csv":
        df.to_csv(trace_path, index=False)
    else:
        df.to_parquet(trace_path, index=False)
    Path(meta_path).write_text(yaml.safe_dump(dict(meta), sort_keys=False))
