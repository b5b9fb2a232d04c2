"""Straggler what-if analysis: ideal run, slowdown S, attribution and characterisation.

Numbers are ratios of mean step times: S = T_real / T_ideal where T_real is the simulated real
run with launch delays removed and T_ideal the run with every op at its typical duration. A
group's S (op type, DP rank, stage) puts only that group back at its real durations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainscope.schemas import optypes as ot
from trainscope.whatif.fit import EARLY_END_S, model_fit
from trainscope.whatif.graph import Graph, build_graph
from trainscope.whatif.layout import Layout
from trainscope.whatif.simulate import Mixed, gate_times, ready_times, simulate

# Scenarios replayed together are chunked so one chunk's time arrays stay near this many
# float64 elements (~128 MiB each), whatever the job size.
CHUNK_ELEMENTS = 1 << 24
TOP_WORKER_SHARE = 0.03  # M_W fixes this share of the workers, rounded up
# Below this relative excess over ideal there is nothing to characterise: float-second
# timestamps near the epoch resolve ~0.2 µs, which alone moves S by about this much.
NO_SLOWDOWN = 1e-4


@dataclass
class WhatIf:
    S: float
    S_per_step: dict[int, float]
    S_optype: dict[str, float]
    S_dp_rank: dict[int, float]
    S_stage: dict[int, float]
    S_worker: list[dict[str, Any]]
    M_W: float
    M_S: float
    sim_error_median: float
    sim_error_p90: float
    steps: int
    workers: int
    steps_dropped: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    step_time_real_s: float = 0.0  # mean observed step time
    step_time_nodelay_s: float = 0.0  # mean simulated step time, launch delays removed
    step_time_ideal_s: float = 0.0
    top_workers: list[tuple[int, int]] = field(default_factory=list)  # (dp_rank, stage) for M_W
    fit: int = 0  # 0: the trace fits the dependency model; else bits of fit.FIT_* (see there)
    # Per template op: the ideal run's duration (compute) or transfer duration (communication).
    ideal_effective_s: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: string keys, NaN as None."""
        return {
            "S": _num(self.S),
            "S_per_step": {str(k): _num(v) for k, v in self.S_per_step.items()},
            "S_optype": {k: _num(v) for k, v in self.S_optype.items()},
            "S_dp_rank": {str(k): _num(v) for k, v in self.S_dp_rank.items()},
            "S_stage": {str(k): _num(v) for k, v in self.S_stage.items()},
            "S_worker": [{**w, "score": _num(w["score"])} for w in self.S_worker],
            "M_W": _num(self.M_W),
            "M_S": _num(self.M_S),
            "sim_error_median": _num(self.sim_error_median),
            "sim_error_p90": _num(self.sim_error_p90),
            "steps": self.steps,
            "workers": self.workers,
            "steps_dropped": list(self.steps_dropped),
            "warnings": list(self.warnings),
            "step_time_real_s": _num(self.step_time_real_s),
            "step_time_nodelay_s": _num(self.step_time_nodelay_s),
            "step_time_ideal_s": _num(self.step_time_ideal_s),
            "top_workers": [{"dp_rank": d, "stage": s} for d, s in self.top_workers],
            "fit": self.fit,
        }


def _num(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


@dataclass
class Observed:
    """What the trace says, reshaped for replay: all arrays are (nodes, steps, dp)."""

    effective_s: np.ndarray  # compute duration, or transfer duration for communication
    delay_s: np.ndarray  # launch delay
    step_time_s: np.ndarray  # (steps,) real step time
    ideal_s: np.ndarray  # (nodes,) the ideal run's effective duration per node
    early_ends: int = 0  # communication ops that ended more than EARLY_END_S before a peer


def layout_graph(layout: Layout) -> Graph:
    return build_graph(layout.template())


def observe(layout: Layout, graph: Graph) -> Observed:
    start = layout.start_s
    end = start + layout.duration_s
    # A send may finish before its peer starts (the data sits in a buffer): no transfer time.
    effective = end - gate_times(graph, start)
    early = int((effective < -EARLY_END_S).sum())
    np.maximum(effective, 0.0, out=effective)
    delay = np.maximum(start - ready_times(graph, end), 0.0)
    step_time = end[graph.final_nodes].max(axis=(0, 2))
    ideal_by_op = np.zeros(len(ot.OPTYPES))
    for code in np.unique(layout.node_op):
        values = effective[layout.node_op == code]
        ideal_by_op[code] = values.mean() if ot.is_compute(int(code)) else np.median(values)
    return Observed(effective, delay, step_time, ideal_by_op[layout.node_op], early)


def analyse(
    layout: Layout, graph: Graph | None = None, progress: Callable[[str], None] | None = None
) -> WhatIf:
    """Replay the trace's job ideal, real and with each group of ops put back at its real
    durations; ``progress`` hears each stage as it starts."""
    say = progress or (lambda _msg: None)
    graph = graph or layout_graph(layout)
    say("observing transfer durations and launch delays")
    obs = observe(layout, graph)
    n_steps, dp_size = obs.effective_s.shape[1:]
    shape = (n_steps, dp_size)

    say("replaying the real run")
    with_delays = simulate(graph, obs.effective_s, shape, obs.delay_s).step_time_s
    sim_error = np.abs(with_delays - obs.step_time_s) / obs.step_time_s
    t_real = simulate(graph, obs.effective_s, shape).step_time_s
    t_ideal = float(simulate(graph, obs.ideal_s[:, None, None], (1, 1)).step_time_s[0])
    mean_real = float(t_real.mean())

    say("attributing to op types and stages")
    s_optype, s_stage = _per_optype_and_stage(layout, graph, obs, t_ideal)
    say("attributing to data-parallel ranks")
    s_dp = _per_dp_rank(graph, obs, t_real, t_ideal)
    s_worker = _per_worker(s_dp, s_stage)

    say("characterising: workers vs stage partitioning")
    top = [(w["dp_rank"], w["stage"])
           for w in s_worker[:max(1, math.ceil(TOP_WORKER_SHARE * len(s_worker) - 1e-9))]]
    m_w, m_s = _characterise(layout, graph, obs, top, mean_real, t_ideal)

    error_median = float(np.median(sim_error))
    error_p90 = float(np.percentile(sim_error, 90))
    real_mean = float(obs.step_time_s.mean())
    fit, fit_warnings = model_fit(error_median, error_p90, real_mean, mean_real, obs.early_ends)
    return WhatIf(
        S=mean_real / t_ideal,
        S_per_step=dict(zip(layout.step_ids.tolist(), (t_real / t_ideal).tolist(), strict=True)),
        S_optype=s_optype,
        S_dp_rank=s_dp,
        S_stage=s_stage,
        S_worker=s_worker,
        M_W=float(m_w),
        M_S=float(m_s),
        sim_error_median=error_median,
        sim_error_p90=error_p90,
        steps=n_steps,
        workers=len(s_worker),
        steps_dropped=list(layout.dropped_steps),
        warnings=fit_warnings + list(layout.warnings) + list(graph.notes),
        step_time_real_s=real_mean,
        step_time_nodelay_s=mean_real,
        step_time_ideal_s=t_ideal,
        top_workers=top,
        fit=fit,
        ideal_effective_s=obs.ideal_s,
    )


def _per_optype_and_stage(
    layout: Layout, graph: Graph, obs: Observed, t_ideal: float
) -> tuple[dict[str, float], dict[int, float]]:
    """S of each op type and of each pipeline stage, with only that group real (on every DP
    rank), all groups replayed together."""
    present = [int(c) for c in np.unique(layout.node_op)]
    by_type = [layout.node_op == c for c in present]
    by_stage = [layout.node_stage == s for s in range(layout.meta.pp_size)]
    group_masks = np.stack(by_type + by_stage)[:, :, None]  # (groups, nodes, 1): every DP rank
    shape = obs.effective_s.shape[1:]
    s_groups = _replay_masks(graph, obs, group_masks, shape).mean(axis=-1) / t_ideal
    s_optype = {ot.OPTYPES[c]: float(v) for c, v in zip(present, s_groups, strict=False)}
    s_stage = {s: float(v) for s, v in enumerate(s_groups[len(present) :])}
    return s_optype, s_stage


def _per_worker(s_dp: dict[int, float], s_stage: dict[int, float]) -> list[dict[str, Any]]:
    """Each worker (DP rank, stage) scored by the smaller of its rank's and its stage's S,
    highest first (ties in worker order)."""
    scores = np.minimum(
        np.array([s_dp[d] for d in range(len(s_dp))])[None, :],
        np.array([s_stage[s] for s in range(len(s_stage))])[:, None],
    )
    dp_size = scores.shape[1]
    flat_order = np.lexsort((np.arange(scores.size), -scores.ravel()))
    return [
        {"dp_rank": int(i % dp_size), "stage": int(i // dp_size), "score": float(scores.flat[i])}
        for i in flat_order
    ]


def _characterise(
    layout: Layout,
    graph: Graph,
    obs: Observed,
    top: list[tuple[int, int]],
    mean_real: float,
    t_ideal: float,
) -> tuple[float, float]:
    """(M_W, M_S): the share of the excess over the ideal run removed by putting the ``top``
    workers back to ideal durations, and by putting the last pipeline stage's ops back (NaN
    when there is no slowdown)."""
    n_nodes, n_steps, dp_size = obs.effective_s.shape
    pp_size = layout.meta.pp_size
    chosen = np.zeros((pp_size, dp_size), dtype=bool)
    for d, s in top:
        chosen[s, d] = True
    keep_real = np.stack(
        [
            ~chosen[layout.node_stage],
            np.broadcast_to((layout.node_stage != pp_size - 1)[:, None], (n_nodes, dp_size)),
        ]
    )
    t_removed = _replay_masks(graph, obs, keep_real, (n_steps, dp_size)).mean(axis=-1)
    excess = mean_real - t_ideal
    if excess <= NO_SLOWDOWN * t_ideal:
        return math.nan, math.nan
    m_w, m_s = ((mean_real - t_removed) / excess).tolist()
    return m_w, m_s


def _replay_masks(
    graph: Graph, obs: Observed, masks: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """Step times (groups, steps) with real durations where ``masks`` (groups, nodes, dp) is
    true and ideal ones elsewhere, launch delays removed."""
    n_groups, n_nodes = masks.shape[:2]
    per_group = n_nodes * shape[0] * shape[1]
    chunk = max(1, CHUNK_ELEMENTS // per_group)
    out = np.empty((n_groups, shape[0]))
    ideal = np.broadcast_to(obs.ideal_s[:, None, None, None], (n_nodes, 1, 1, 1))
    for lo in range(0, n_groups, chunk):
        hi = min(n_groups, lo + chunk)
        mask = np.ascontiguousarray(masks[lo:hi].transpose(1, 0, 2))[:, :, None, :]
        mixed = Mixed(obs.effective_s, ideal, mask)
        out[lo:hi] = simulate(graph, mixed, (hi - lo, *shape)).step_time_s
    return out


def _per_dp_rank(graph: Graph, obs: Observed, t_real: np.ndarray, t_ideal: float) -> dict:
    """S of each DP rank with only that rank real. The other ranks all run the ideal schedule,
    so they are identical and one column stands for all of them: the DP axis has size 2."""
    n_nodes, n_steps, dp_size = obs.effective_s.shape
    if dp_size == 1:
        return {0: float(t_real.mean() / t_ideal)}
    real_t = obs.effective_s.transpose(0, 2, 1)  # (nodes, dp, steps)
    mask = np.broadcast_to(np.array([True, False]), (n_nodes, 1, 1, 2))
    ideal = np.broadcast_to(obs.ideal_s[:, None, None, None], (n_nodes, 1, 1, 1))
    chunk = max(1, CHUNK_ELEMENTS // (n_nodes * n_steps * 2))
    result: dict[int, float] = {}
    for lo in range(0, dp_size, chunk):
        hi = min(dp_size, lo + chunk)
        mixed = Mixed(real_t[:, lo:hi, :, None], ideal, mask)
        times = simulate(graph, mixed, (hi - lo, n_steps, 2)).step_time_s
        for d, t in zip(range(lo, hi), times.mean(axis=-1), strict=True):
            result[d] = float(t / t_ideal)
    return result
