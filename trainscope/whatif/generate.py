"""Synthetic Megatron-style op traces: 1F1B pipeline schedules (optionally interleaved), with
knobs to make workers, stages or single ops slow.

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

from trainscope.whatif import optypes as ot
from trainscope.whatif.graph import build_graph
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
}


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


def stage_schedule(spec: JobSpec, stage: int) -> list[tuple[int, int, int]]:
    """(optype code, model chunk, micro-batch) of one stage's ops in run order (Megatron 1F1B,
    interleaved when vpp_size > 1)."""
    p, v, m = spec.pp_size, spec.vpp_size, spec.microbatches
    if v > 1 and m % p:
        raise ValueError(f"interleaved schedules need microbatches ({m}) divisible by pp ({p})")
    total = m * v
    warmup = min(total, (p - stage - 1) * 2 + (v - 1) * p if v > 1 else p - stage - 1)
    last_g = p * v - 1

    def chunk_mb(k: int, backward: bool) -> tuple[int, int]:
        c = (k // p) % v if v > 1 else 0
        mb = (k // (p * v)) * p + k % p if v > 1 else k
        return (v - 1 - c if backward else c), mb

    ops: list[tuple[int, int, int]] = []
    gathered: set[int] = set()
    backwards_left = {c: m for c in range(v)}

    def forward(k: int) -> None:
        c, mb = chunk_mb(k, False)
        g = c * p + stage
        if spec.distributed_optimizer and c not in gathered:
            gathered.add(c)
            ops.append((ot.CODE["params-all-gather"], c, -1))
        if g > 0:
            ops.append((ot.FORWARD_RECV, c, mb))
        ops.append((ot.FORWARD_COMPUTE, c, mb))
        if g < last_g:
            ops.append((ot.FORWARD_SEND, c, mb))

    def backward(k: int) -> None:
        c, mb = chunk_mb(k, True)
        g = c * p + stage
        if g < last_g:
            ops.append((ot.BACKWARD_RECV, c, mb))
        ops.append((ot.BACKWARD_COMPUTE, c, mb))
        if g > 0:
            ops.append((ot.BACKWARD_SEND, c, mb))
        backwards_left[c] -= 1
        if spec.distributed_optimizer and backwards_left[c] == 0:
            ops.append((ot.CODE["grads-reduce-scatter"], c, -1))

    for k in range(warmup):
        forward(k)
    for i in range(total - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(total - warmup, total):
        backward(i)
    if not spec.distributed_optimizer:
        ops.append((ot.CODE["separate-grads-all-reduce"], -1, -1))
    ops.append((ot.CODE["layernorm-grads-all-reduce"], -1, -1))
    if p > 1 and stage in (0, p - 1):
        ops.append((ot.EMBEDDING_ALL_REDUCE, -1, -1))
    ops.append((ot.CLIP, -1, -1))
    ops.append((ot.OPTIMIZER, -1, -1))
    return ops


def generate(spec: JobSpec) -> tuple[pd.DataFrame, dict[str, int]]:
    """Return the op trace (one row per op) and the job metadata."""
    rng = np.random.default_rng(spec.seed)
    schedules = [stage_schedule(spec, s) for s in range(spec.pp_size)]
    stage_offsets = np.cumsum([0] + [len(s) for s in schedules])
    flat = [(s, *op) for s, sched in enumerate(schedules) for op in sched]
    node_stage = np.array([f[0] for f in flat])
    node_op = np.array([f[1] for f in flat])
    node_mc = np.array([f[2] for f in flat])
    node_mb = np.array([f[3] for f in flat])
    node_gmc = np.where(node_mc >= 0, node_mc * spec.pp_size + node_stage, -1)
    node_seq = np.zeros(len(flat), dtype=np.int64)
    seen: dict[tuple[int, int], int] = {}
    for n, (s, code, _c, _m) in enumerate(flat):
        node_seq[n] = seen.get((s, code), 0)
        seen[(s, code)] = node_seq[n] + 1
    graph = build_graph(node_stage, node_op, node_seq, node_mc, node_gmc, node_mb, stage_offsets)

    step_ids = spec.step_ids
    shape = (len(flat), len(step_ids), spec.dp_size)
    base = np.array([BASE_DURATION_S[name] for name in ot.OPTYPES])[node_op]
    effective = base[:, None, None] * rng.lognormal(0.0, spec.noise, size=shape)
    compute = np.isin(node_op, list(ot.COMPUTE))[:, None, None]
    factor = np.ones((spec.pp_size, spec.dp_size))
    for s, f in spec.stage_factor.items():
        factor[s, :] *= f
    for (d, s), f in spec.worker_factor.items():
        factor[s, d] *= f
    effective = np.where(compute, effective * factor[node_stage][:, None, :], effective)
    delay = rng.exponential(spec.launch_jitter_s, size=shape)
    firsts = stage_offsets[:-1]
    delay[firsts] = rng.uniform(0.0, spec.step_start_jitter_s, size=(len(firsts), *shape[1:]))
    for inj in spec.injections:
        target = delay if inj.delay else effective
        sel = _select(inj, node_op, node_stage, node_seq, step_ids, spec.dp_size)
        target[sel] += inj.extra_s
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
