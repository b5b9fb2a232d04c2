"""Per-rank tables derived from a window, shared by the built-in detectors.

Times are normalised *per step* (a window may hold 9 steps of one rank and 10 of another), and
peers are compared with robust statistics (median and MAD) so one straggler cannot drag the
reference it is compared with.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pandas as pd

from trainscope.schemas import metrics as m
from trainscope.schemas.metrics import (
    THROTTLE_REASON_NAMES,
    THROTTLE_REASONS,
    THROTTLED_FRAC,
    THROTTLING_REASONS_MASK,
)
from trainscope.schemas.window import WindowView

# Layers whose time a rank spends on its own account; collective time can be waiting for peers.
OWN_WORK_CATEGORY = {
    "torch_op": "gpu-compute",
    "cuda_kernel": "gpu-compute",
    "python": "gpu-compute",
    "cuda_api": "gpu-compute",
    "memcpy": "pcie",
    "dataloader": "dataloader",
    "gc": "python-gc",
    "sched": "cpu-contention",
    # Device (CUDA event) time of the host phases: the GPU's own work, where it has it.
    m.DEVICE_PHASE_LAYER: "gpu-compute",
}
# A collective's device time (``gpu_collective``) is waiting as its host time is: on the GPU
# too, the rank that reaches the collective last waits least in it.
WAIT_LAYERS = frozenset({"collective", m.DEVICE_COLLECTIVE_LAYER})
# Layers of a phase's device time (CUDA events), and of the host time it replaces: with CUDA's
# asynchronous execution the host time of forward or of an NCCL call measures launch.
DEVICE_CLOCK_LAYERS = {m.DEVICE_PHASE_LAYER: "torch_op", m.DEVICE_COLLECTIVE_LAYER: "collective"}
# What shows a job runs on GPUs: a GPU layer in its summaries, or a GPU reading from the NVML
# sampler (the agent). Without either, own-work compute is called ``compute``, not
# ``gpu-compute``: a CPU-only job (gloo on CPU) has no GPU to blame.
GPU_LAYERS = frozenset({"cuda_kernel", "cuda_api", "memcpy", "gpu_user_annotation",
                        *DEVICE_CLOCK_LAYERS})
GPU_METRICS = frozenset({
    m.SM_CLOCK_MHZ, m.SM_CLOCK_MAX_MHZ, m.MEM_CLOCK_MHZ, m.SM_UTIL_PCT, m.MEM_UTIL_PCT,
    m.POWER_W, m.POWER_LIMIT_W, m.THROTTLE_REASONS, m.THROTTLED_FRAC,
    m.PROCESS_GPU_UTIL_PCT, m.PROCESS_GPU_MEM_BYTES,
})
# MAD × 1.4826 estimates the standard deviation of normally distributed values.
MAD_TO_SIGMA = 1.4826
# Column of :func:`throttling_shares` with the share of readings carrying any throttling reason.
ANY_THROTTLING = "any"
_THROTTLING_BITS = {
    bit: name for bit, name in THROTTLE_REASON_NAMES.items() if bit & THROTTLING_REASONS_MASK
}


def always_on_view(view: WindowView) -> WindowView:
    """The window without the call-path summaries of an on-demand profile of some of its ranks.

    A profile (the closed loop's, or ``trainscope profile``) sends every function it saw with
    its call path on the ranks it covers only; compared with peers that sent none of them, its
    Python frames and operators would read as extra work of the profiled ranks ("train.py(73):
    <module> 88 ms/step vs 0 ms on peers"). Detectors compare what every rank measures all the
    time; where every rank sent call paths (replayed profiler traces), they are the data and
    stay.
    """
    summaries = view.summaries
    if summaries.empty:
        return view
    profiled = summaries["callpath_id"] != 0
    if not profiled.any():
        return view
    ranks = set(summaries["rank"].unique()) | set(view.steps["rank"].unique())
    if set(summaries.loc[profiled, "rank"].unique()) >= ranks:
        return view
    return dataclasses.replace(view, summaries=summaries[~profiled].reset_index(drop=True))


def device_clock_view(view: WindowView) -> WindowView:
    """The window with each phase a rank also timed on the device read on that clock only.

    The PyTorch producer of a CUDA job sends forward, backward, the optimizer step and the
    collectives twice: their host times (``torch_op``, ``collective``), which measure launch,
    and their device times (``gpu_phase``, ``gpu_collective``). Where both came for a rank, the
    host row is left out, so that every detector compares the GPU's work where it ran (a slow
    GPU's backward, not the next call that waited for it) without counting it twice; the store
    keeps both."""
    s = view.summaries
    if s.empty:
        return view
    # Tested on the Arrow strings in place: turning 573,600 of them into Python objects first
    # (10,240 ranks) took 47 ms a window, for a test that most jobs' windows fail.
    device = s["layer"].isin(list(DEVICE_CLOCK_LAYERS)).to_numpy(dtype=bool)
    if not device.any():
        return view
    layers = s["layer"].to_numpy()
    timed = set(zip(s["rank"].to_numpy()[device].tolist(),
                    [DEVICE_CLOCK_LAYERS[x] for x in layers[device].tolist()],
                    s["name"].to_numpy()[device].tolist(), strict=True))
    host = np.isin(layers, list(DEVICE_CLOCK_LAYERS.values()))
    rows = np.flatnonzero(host)
    keys = zip(s["rank"].to_numpy()[rows].tolist(), layers[rows].tolist(),
               s["name"].to_numpy()[rows].tolist(), strict=True)
    drop = rows[[key in timed for key in keys]]
    if not len(drop):
        return view
    keep = np.ones(len(s), dtype=bool)
    keep[drop] = False
    return dataclasses.replace(view, summaries=s[keep].reset_index(drop=True))


def gpu_evidence(view: WindowView) -> bool:
    """Whether anything GPU-shaped is in the window: a GPU layer or a GPU metric sample."""
    if view.summaries["layer"].isin(GPU_LAYERS).any():
        return True
    return bool(not view.metrics.empty and view.metrics["name"].isin(GPU_METRICS).any())


def honest_category(category: str, gpu: bool) -> str:
    """``gpu-compute`` becomes ``compute`` for a job without GPU evidence (no ``gpu-*``
    category without a GPU)."""
    return "compute" if category == "gpu-compute" and not gpu else category


def steps_per_rank(view: WindowView) -> pd.Series:
    """Steps each rank ran in the window (at least 1, so per-step figures stay finite)."""
    return view.derived("steps_per_rank", _steps_per_rank).copy()


def _steps_per_rank(view: WindowView) -> pd.Series:
    if not view.steps.empty:
        counts = view.steps.groupby("rank").size()
    else:
        s = view.summaries
        counts = s[s["layer"] == "step"].groupby("rank")["count"].sum()
    # The ranks counted are among the window's: those with steps, or with summaries.
    ranks = pd.Index(view.ranks(), name="rank")
    return counts.reindex(ranks, fill_value=0).clip(lower=1).astype(float)


def step_time_ns(view: WindowView) -> float:
    """Median step duration of the job in this window (NaN if unknown)."""
    if not view.steps.empty:
        return float(view.steps["duration_ns"].median())
    s = view.summaries[view.summaries["layer"] == "step"]
    if s.empty:
        return float("nan")
    return float((s["total_ns"] / s["count"].clip(lower=1)).median())


def own_work_columns(columns: pd.Index | list) -> list:
    """The ``(layer, name)`` columns of a rank's own work. Of the two counts of a process's
    wait for a CPU, the agent's and the producer's (the same waiting), only the agent's when
    both came: summed, the one wait would count twice."""
    own = [c for c in columns if c[0] in OWN_WORK_CATEGORY]
    if (m.SCHED_LAYER, m.RUNQUEUE_WAIT) in own:
        own = [c for c in own if c != (m.SCHED_LAYER, m.PROCESS_RUNQUEUE_WAIT)]
    return own


def group_codes(layout: pd.DataFrame, keys: list[str]) -> pd.Series:
    """Per rank of ``layout`` (index), an integer shared by the ranks with the same ``keys``
    values, in the order of those values. A rank without them (outside the declared topology)
    gets a negative code of its own: it shares a group with no one. One code for all when
    ``keys`` is empty (the whole job)."""
    if not keys:
        return pd.Series(0, index=layout.index, dtype=np.int64)
    codes = np.array(layout.groupby(keys, sort=True, dropna=True).ngroup(), dtype=float)
    unknown = np.isnan(codes)
    codes[unknown] = -1 - np.flatnonzero(unknown)
    return pd.Series(codes.astype(np.int64), index=layout.index)


def per_step_times(view: WindowView) -> pd.DataFrame:
    """ns per step, index rank, one column per ``layer/name`` (call paths summed)."""
    return view.derived("per_step_times", _per_step_times).copy()


def _per_step_times(view: WindowView) -> pd.DataFrame:
    s = view.summaries
    if s.empty:
        return pd.DataFrame()
    table = _summed_times(s)
    if table is None:
        table = s.pivot_table(
            index="rank", columns=["layer", "name"], values="total_ns", aggfunc="sum",
            fill_value=0)
    return table.div(steps_per_rank(view).reindex(table.index, fill_value=1.0), axis=0)


def _summed_times(s: pd.DataFrame) -> pd.DataFrame | None:
    """``total_ns`` summed per rank (index) and ``(layer, name)`` (columns, sorted), 0 where a
    rank has none: the pivot table of the summaries, by codes and one bincount (the pivot's
    sorts and unstack cost a tenth of a second a window at 10,240 ranks). None where a sum
    could leave float64's exact integers (never in practice: 2**53 ns is 104 days), so that
    the pivot's int64 sums are kept."""
    total = s["total_ns"].to_numpy()
    if total.dtype.kind not in "iu" or np.abs(total).sum(dtype=np.float64) >= 2.0**53:
        return None
    layer_codes, layers = pd.factorize(s["layer"], sort=True)
    name_codes, names = pd.factorize(s["name"], sort=True)
    keep = (layer_codes >= 0) & (name_codes >= 0)  # the pivot drops rows without a key
    if not keep.any():
        return None
    if not keep.all():
        layer_codes, name_codes, total = layer_codes[keep], name_codes[keep], total[keep]
    ranks, rank_at = np.unique(s["rank"].to_numpy()[keep], return_inverse=True)
    # (layer, name) pairs present, ascending by layer then name, as the pivot orders columns.
    pairs, pair_at = np.unique(layer_codes.astype(np.int64) * len(names) + name_codes,
                               return_inverse=True)
    # Laid out rank by rank, as the pivot's frame is (hence copy=False below): a row's sum over
    # the columns then adds in the same order, to the bit.
    sums = np.bincount(rank_at * len(pairs) + pair_at, weights=total.astype(np.float64),
                       minlength=len(ranks) * len(pairs)).reshape(len(ranks), len(pairs))
    columns = pd.MultiIndex(levels=[layers, names],
                            codes=[pairs // len(names), pairs % len(names)],
                            names=["layer", "name"])
    return pd.DataFrame(sums, index=pd.Index(ranks, name="rank"), columns=columns, copy=False)


def runqueue_wait_per_step(view: WindowView) -> pd.Series:
    """ns per step each rank spent runnable without a CPU (index rank; empty when not measured):
    the agent's figure when it came, else the producer's (the same waiting, never added)."""
    table = view.derived("per_step_times", _per_step_times)
    for name in m.RUNQUEUE_WAIT_FUNCTIONS:  # the agent's first
        if (m.SCHED_LAYER, name) in table.columns:
            return table[(m.SCHED_LAYER, name)]
    return pd.Series(dtype=float)


def per_call_bandwidth(view: WindowView) -> pd.DataFrame:
    """Achieved bytes/s per rank and function, for functions that move bytes."""
    return view.derived("per_call_bandwidth", _per_call_bandwidth).copy()


def _per_call_bandwidth(view: WindowView) -> pd.DataFrame:
    s = view.summaries
    # The columns read before the rows: not the latency sketches' lists (costly to take).
    moving = s[["rank", "layer", "name", "bytes_total", "total_ns"]][
        (s["bytes_total"] > 0) & (s["total_ns"] > 0)]
    if moving.empty:
        return pd.DataFrame()
    sums = moving.groupby(["rank", "layer", "name"])[["bytes_total", "total_ns"]].sum()
    bandwidth = sums["bytes_total"] / (sums["total_ns"] / 1e9)
    return bandwidth.unstack(["layer", "name"])


def metric_means(view: WindowView) -> pd.DataFrame:
    """Mean of each metric per rank over the window (index rank, one column per metric)."""
    # Three detectors read it, the mixture's once per finding: a pivot of every sample.
    return view.derived("metric_means", _metric_means).copy()


def _metric_means(view: WindowView) -> pd.DataFrame:
    m = view.metrics
    if m.empty:
        return pd.DataFrame()
    m = m[m["rank"] >= 0]
    return m.pivot_table(index="rank", columns="name", values="value", aggfunc="mean")


def throttling_shares(view: WindowView) -> pd.DataFrame:
    """Per rank (index), the share (0..1) of GPU readings in the window with each throttling
    reason (one column per reason name) and with any of them (column ``any``).

    Each ``throttle_reasons`` sample is one reading, judged on its own through the throttling
    mask (idle and clock settings are reasons, not throttling). A producer that condensed its
    readings already sends the ``any`` share as ``throttled_frac``, which is used where present;
    its reason sample is then an OR over the window, so that rank's per-reason shares are unknown
    (NaN) rather than taken from the OR.
    """
    return view.derived("throttling_shares", _throttling_shares).copy()


def _throttling_shares(view: WindowView) -> pd.DataFrame:
    metrics = view.metrics
    if metrics.empty:
        return pd.DataFrame(columns=[*_THROTTLING_BITS.values(), ANY_THROTTLING], dtype=float)
    metrics = metrics[metrics["rank"] >= 0]
    reasons = metrics[metrics["name"] == THROTTLE_REASONS]
    bits = reasons["value"].astype(np.int64)
    columns = {name: (bits & bit) != 0 for bit, name in _THROTTLING_BITS.items()}
    columns[ANY_THROTTLING] = (bits & THROTTLING_REASONS_MASK) != 0
    per_reading = pd.DataFrame(columns).groupby(reasons["rank"]).mean().astype(float)
    condensed = metrics[metrics["name"] == THROTTLED_FRAC].groupby("rank")["value"].mean()
    shares = per_reading.reindex(per_reading.index.union(condensed.index))
    shares.loc[condensed.index] = np.nan
    shares.loc[condensed.index, ANY_THROTTLING] = condensed.astype(float)
    shares.index.name = "rank"
    return shares


def throttled_fraction(view: WindowView) -> pd.Series:
    """Per rank, the share (0..1) of GPU readings in the window with any throttling reason."""
    return throttling_shares(view)[ANY_THROTTLING].dropna()


def robust_z(
    values: pd.Series, groups: pd.Series | None, floor: float, rel_floor: float = 0.02
) -> tuple[pd.Series, pd.Series]:
    """(z, reference) of each value against the median of its peer group.

    The scale is the MAD, but never below ``rel_floor`` of the median nor ``floor``: a group
    of near-identical peers must not turn a 0.1% wobble into a 50-sigma outlier. Groups with
    fewer than 3 members give NaN (no robust reference).
    """
    frame = pd.DataFrame({"v": values, "g": 0 if groups is None else groups})
    grouped = frame.groupby("g")["v"]
    median = grouped.transform("median")
    mad = (frame["v"] - median).abs().groupby(frame["g"]).transform("median")
    size = grouped.transform("size")
    scale = np.maximum(np.maximum(MAD_TO_SIGMA * mad, rel_floor * median.abs()), floor)
    z = (frame["v"] - median) / scale
    z[size < 3] = np.nan
    return z, median


# Groups of fewer members give no robust reference (robust_z's rule).
MIN_ROBUST_GROUP = 3


@contextmanager
def quiet_nan() -> Iterator[None]:
    """numpy's warnings about NaN medians off: a cell with no value in any row of its group
    has no reference, its median is NaN on purpose, and "All-NaN slice" says only that."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
        yield


def median_skipna(values: np.ndarray, axis: int) -> np.ndarray:
    """pandas' median (NaN skipped), by numpy's faster path when there is no NaN; the same
    numbers either way, since a median is a selection and at most one halving of a sum."""
    if np.isnan(values).any():
        with quiet_nan():
            return np.nanmedian(values, axis=axis)
    return np.median(values, axis=axis)


def group_medians(values: np.ndarray, groups: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(median, size): each cell's column median over the rows of its group, and each row's
    group size; pandas' ``groupby(groups).transform("median")`` and ``("size")`` of a
    ranks × columns matrix, computed per group rather than per column (one group when
    ``groups`` is None; ``groups`` holds no NaN)."""
    if groups is None:
        return (np.broadcast_to(median_skipna(values, axis=0), values.shape).copy(),
                np.full(len(values), len(values), dtype=np.int64))
    median = np.empty_like(values)
    size = np.empty(len(values), dtype=np.int64)
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        # Columns × rows: the median runs along contiguous memory.
        median[rows] = median_skipna(values[rows].T, axis=1)
        size[rows] = len(rows)
    return median, size


def robust_z_matrix(
    values: np.ndarray, groups: np.ndarray | None, floor: float | np.ndarray,
    rel_floor: float = 0.02,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`robust_z` of every column of a ranks × columns matrix at once (``floor`` per
    column or for all), to the bit: a pandas group-by per column cost most of a detector's
    time at 10,240 ranks."""
    median, size = group_medians(values, groups)
    mad, _ = group_medians(np.abs(values - median), groups)
    scale = np.maximum(np.maximum(MAD_TO_SIGMA * mad, rel_floor * np.abs(median)), floor)
    with np.errstate(all="ignore"):
        z = (values - median) / scale
    z[size < MIN_ROBUST_GROUP] = np.nan
    return z, median
