"""Which NVML clocks-event reasons make a slow GPU a throttled one.

A rank with a slow GPU (a gpu-compute suspect, its SM clock normal) is run through the peer
detector with its NVML reason readings set to one reason bit at a time: only the throttling
reasons (power and thermal limits) may turn it into gpu-throttle; idle and clock settings must
not. Readings are judged one by one, so a reason seen in a minority of them does not count.
"""

from __future__ import annotations

import dataclasses
from functools import cache

import pandas as pd
import pytest

from trainscope.detectors.base import WindowView
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.producers.agent.aggregate import WindowAggregator
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas import metrics as m
from trainscope.schemas.records import MetricSample
from trainscope.streams.pipeline import EmbeddedPipeline

SLOW = 13
THROTTLING = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
              "hw_power_brake_slowdown"}


@cache
def slow_gpu_windows() -> tuple[WindowView, ...]:
    # One NVML reading a second per GPU, as the host agent samples.
    spec = ClusterSpec(steps=80, seed=11, dp=4, pp=2, tp=2, metric_interval_s=1.0)
    views: list[WindowView] = []
    pipeline = EmbeddedPipeline([], window_s=15.0, on_window=lambda v, f: views.append(v))
    for records in SimulatedCluster(spec, parse_faults([f"slow-gpu:rank={SLOW},factor=1.4"])
                                    ).batches():
        pipeline.process_records(records)
    pipeline.finish()
    return tuple(views)


def with_reasons(views: tuple[WindowView, ...], reasons: list[int]) -> list[WindowView]:
    """The views with the slow rank's reason readings replaced by ``reasons``, cycled over the
    readings of the whole run."""
    out, i = [], 0
    for view in views:
        metrics = view.metrics.copy()
        rows = metrics.index[(metrics["rank"] == SLOW) & (metrics["name"] == m.THROTTLE_REASONS)]
        metrics.loc[rows, "value"] = [float(reasons[(i + k) % len(reasons)])
                                      for k in range(len(rows))]
        i += len(rows)
        out.append(dataclasses.replace(view, metrics=metrics))
    return out


def categories(views: list[WindowView]) -> set[str]:
    detector = PeerDiffDetector()
    return {f.category for v in views for f in detector.detect(v) if f.rank == SLOW}


def test_the_slow_gpu_is_a_compute_suspect_without_reasons() -> None:
    views = with_reasons(slow_gpu_windows(), [0])
    assert sum((v.metrics["rank"] == SLOW).any() for v in views) >= 3
    assert categories(views) == {"gpu-compute"}


@pytest.mark.parametrize("bit", sorted(m.THROTTLE_REASON_NAMES))
def test_each_reason_bit_alone(bit: int) -> None:
    name = m.THROTTLE_REASON_NAMES[bit]
    views = with_reasons(slow_gpu_windows(), [bit])
    expected = "gpu-throttle" if name in THROTTLING else "gpu-compute"
    assert categories(views) == {expected}, name


def test_idle_alongside_throttling_still_counts_and_a_rare_blip_does_not() -> None:
    both = with_reasons(slow_gpu_windows(), [0x1 | 0x40])
    assert categories(both) == {"gpu-throttle"}
    # One power-cap reading in ten: the OR over a window holding it would say "throttled"; per
    # reading, it is 10%, below the detector's threshold.
    blip = with_reasons(slow_gpu_windows(), [0x4] + [0x1] * 9)
    assert categories(blip) == {"gpu-compute"}


def test_the_agents_condensed_share_is_judged_per_reading() -> None:
    """Readings through the host agent's window aggregation: the OR of the window holds the
    power cap, the share of throttled readings (1 in 5) stays below the threshold."""
    readings = [0x4, 0x1, 0x1, 0x0, 0x1]
    agg = WindowAggregator()
    agg.add([MetricSample(job_id="j", rank=SLOW, device=0, ts_ns=i, name=m.THROTTLE_REASONS,
                          value=float(r)) for i, r in enumerate(readings)])
    out = {r.name: r.value for r in agg.flush(0, 10) if isinstance(r, MetricSample)}
    assert out == {m.THROTTLE_REASONS: float(0x5), m.THROTTLED_FRAC: 0.2}
    views = []
    for v in slow_gpu_windows():
        metrics = v.metrics[~((v.metrics["rank"] == SLOW)
                              & (v.metrics["name"] == m.THROTTLE_REASONS))]
        condensed = pd.DataFrame([
            {**metrics.iloc[0].to_dict(), "rank": SLOW, "name": name, "value": value}
            for name, value in out.items()
        ])
        views.append(dataclasses.replace(v, metrics=pd.concat([metrics, condensed])))
    assert categories(views) == {"gpu-compute"}
    heavy = [dataclasses.replace(v, metrics=v.metrics.assign(
        value=v.metrics["value"].where(v.metrics["name"] != m.THROTTLED_FRAC, 0.6)))
        for v in views]
    assert categories(heavy) == {"gpu-throttle"}
