"""Which NVML clocks-event reasons make a slow GPU a throttled one, judged against its peers.

A rank with a slow GPU (a gpu-compute suspect) is run through the peer detector with its NVML
readings — and its peers' — set to chosen values. Only the throttling reasons (power and thermal
limits) may turn it into gpu-throttle, and only when the suspect has them more often than its
peers: on a real cluster every busy GPU is power-capped all the time. The mixture detector,
which names gpu-throttle from an SM clock drop, is held to the same rule.

Real data, read on an NVIDIA H100 80GB HBM3 (driver 580.159.04, power limit 700 W) with NVML
every 50 ms (``benchmarks/gpu_throttle_duty.py``, figures in ``benchmarks/README.md``; the
idle and full-load readings were also taken through trainscope's own ``NvmlSampler``):

- idle: reasons 0x0, SM clock 1980 MHz, ~119 W;
- bf16 matrix products all the time: reasons 0x4 (``sw_power_cap``) in every reading, SM clock
  1305–1440 MHz (mean 1401), ~695–700 W, 97–100% utilisation;
- the same products 70% of a 400 ms step, waiting the rest: 0x4 in every reading, SM clock mean
  1620 MHz; 50% of the step: 0x4 in every reading, mean 1733 MHz;
- with 5 s steps the power cap follows the load: computing all the time, 0x4 in 99% of the
  readings (mean 1366 MHz); half of each step, in 56–60% (mean 1659–1684 MHz).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache

import pandas as pd
import pytest

from trainscope.detectors.base import WindowView
from trainscope.detectors.features import throttling_shares
from trainscope.detectors.mixture import MixtureDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.throttle import BUSIER_UTIL_RATIO
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.agent.aggregate import WindowAggregator
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding, MetricSample

SLOW = 13
THROTTLING = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
              "hw_power_brake_slowdown"}

# The H100's readings (see the module docstring).
H100_IDLE_REASONS = 0x0
H100_BUSY_REASONS = 0x4
H100_BUSY_SM_MHZ = [1305.0, 1350.0, 1395.0, 1440.0]  # the range seen under full load
H100_MEAN_SM_MHZ_BUSY_100 = 1401.0
H100_MEAN_SM_MHZ_BUSY_70 = 1620.0
H100_POWER_LIMIT_W = 700.0
# 5 s steps: a straggler computing all the time, its peers half of each step.
H100_LONG_STEP_BUSY_100 = [H100_BUSY_REASONS] * 99 + [H100_IDLE_REASONS]
# 29 of every 50 readings capped (58%), spread evenly as the steps are.
H100_LONG_STEP_BUSY_50 = [H100_BUSY_REASONS if (k * 29) // 50 != ((k + 1) * 29) // 50
                          else H100_IDLE_REASONS for k in range(50)]
H100_LONG_STEP_SM_MHZ_BUSY_100 = 1366.0
H100_LONG_STEP_SM_MHZ_BUSY_50 = 1672.0


@cache
def slow_gpu_windows() -> tuple[WindowView, ...]:
    # One NVML reading a second per GPU, as the host agent samples.
    spec = ClusterSpec(steps=80, seed=11, dp=4, pp=2, tp=2, metric_interval_s=1.0)
    views: list[WindowView] = []
    pipeline = EmbeddedStreamJob([], window_s=15.0, on_window=lambda v, f: views.append(v))
    for records in SimulatedCluster(spec, parse_faults([f"slow-gpu:rank={SLOW},factor=1.4"])
                                    ).batches():
        pipeline.process_records(records)
    pipeline.finish()
    return tuple(views)


def with_metric(
    views: tuple[WindowView, ...] | list[WindowView],
    name: str,
    suspect: list[float],
    peers: list[float] | None = None,
) -> list[WindowView]:
    """The views with the slow rank's readings of ``name`` replaced by ``suspect`` (cycled over
    the run), and every other rank's by ``peers`` where given (cycled over each rank's own
    readings, so every peer has the same share of each value)."""
    out, i = [], 0
    seen: dict[int, int] = {}  # readings of each peer so far
    for view in views:
        metrics = view.metrics.reset_index(drop=True)
        mine = (metrics["rank"] == SLOW) & (metrics["name"] == name)
        rows = metrics.index[mine]
        metrics.loc[rows, "value"] = [float(suspect[(i + k) % len(suspect)])
                                      for k in range(len(rows))]
        i += len(rows)
        if peers is not None:
            theirs = metrics.index[(metrics["rank"] != SLOW) & (metrics["name"] == name)]
            values = []
            for rank in metrics.loc[theirs, "rank"]:
                k = seen.get(int(rank), 0)
                seen[int(rank)] = k + 1
                values.append(float(peers[k % len(peers)]))
            metrics.loc[theirs, "value"] = values
        out.append(dataclasses.replace(view, metrics=metrics))
    return out


def with_reasons(views, suspect: list[int], peers: list[int] | None = None) -> list[WindowView]:
    return with_metric(views, m.THROTTLE_REASONS, [float(r) for r in suspect],
                       None if peers is None else [float(r) for r in peers])


def with_added_metric(views, name: str, value: Callable[[int], float]) -> list[WindowView]:
    """The views with one reading of ``name`` per rank added (``value(rank)``)."""
    out = []
    for view in views:
        first = view.metrics.groupby("rank").head(1)
        extra = first.assign(name=name, value=[value(int(r)) for r in first["rank"]])
        out.append(dataclasses.replace(view, metrics=pd.concat([view.metrics, extra],
                                                                  ignore_index=True)))
    return out


def findings(views: list[WindowView]) -> list[Finding]:
    detector = PeerDiffDetector()
    return [f for v in views for f in detector.detect(v) if f.rank == SLOW]


def categories(views: list[WindowView]) -> set[str]:
    return {f.category for f in findings(views)}


def test_the_simulated_cluster_is_power_capped_like_the_h100_and_stays_gpu_compute() -> None:
    views = slow_gpu_windows()
    assert sum((v.metrics["rank"] == SLOW).any() for v in views) >= 3
    shares = pd.concat([throttling_shares(v) for v in views])
    # Every busy GPU, the healthy peers too, reports the power cap, as on the H100.
    assert shares["sw_power_cap"].min() == 1.0
    assert categories(list(views)) == {"gpu-compute"}


def test_without_any_reason_the_slow_gpu_is_a_compute_suspect() -> None:
    views = with_reasons(slow_gpu_windows(), [H100_IDLE_REASONS], peers=[H100_IDLE_REASONS])
    assert categories(views) == {"gpu-compute"}


@pytest.mark.parametrize("background", [H100_IDLE_REASONS, H100_BUSY_REASONS],
                         ids=["peers-uncapped", "peers-power-capped"])
@pytest.mark.parametrize("bit", sorted(m.THROTTLE_REASON_NAMES))
def test_each_reason_bit_on_the_suspect_alone(bit: int, background: int) -> None:
    """Every reading of every rank carries ``background``; the suspect's also carry ``bit``."""
    name = m.THROTTLE_REASON_NAMES[bit]
    views = with_reasons(slow_gpu_windows(), [bit | background], peers=[background])
    # The power cap alone is no evidence on the straggler, busier than its peers: its own load
    # takes it there (test_only_the_suspect_power_capped_is_throttling_unless_...).
    held_back_more = name in THROTTLING and not (bit & background) and name != "sw_power_cap"
    assert categories(views) == {"gpu-throttle" if held_back_more else "gpu-compute"}, name


def test_all_ranks_power_capped_as_on_the_h100_the_slow_one_stays_gpu_compute() -> None:
    """The H100's full-load readings on every rank, its clock the lowest of them because it
    computes all the time while its peers wait 30% of the step: not throttling."""
    views = with_reasons(slow_gpu_windows(), [H100_BUSY_REASONS], peers=[H100_BUSY_REASONS])
    views = with_metric(views, m.SM_CLOCK_MHZ, [H100_MEAN_SM_MHZ_BUSY_100],
                        peers=[H100_MEAN_SM_MHZ_BUSY_70])
    found = findings(views)
    assert {f.category for f in found} == {"gpu-compute"}
    ratio = H100_MEAN_SM_MHZ_BUSY_100 / H100_MEAN_SM_MHZ_BUSY_70
    assert ratio < 0.9  # the clock alone would have said "throttled"
    assert all(f.evidence["sm_clock_ratio"] == pytest.approx(ratio) for f in found)
    assert all(f.evidence["throttled_frac"] == 1.0 == f.evidence["peers_throttled_frac"]
               for f in found)
    # The same clocks on uncapped GPUs are a throttled one: nothing else would lower its clock.
    uncapped = with_reasons(views, [H100_IDLE_REASONS], peers=[H100_IDLE_REASONS])
    assert categories(uncapped) == {"gpu-throttle"}


def test_with_long_steps_the_straggler_is_capped_more_often_but_not_throttled() -> None:
    """With 5 s steps its peers, waiting half of each step for it, show the cap in 58% of the
    readings and it in 99%: an excess of 0.41 that its load explains, not a throttle."""
    views = with_reasons(slow_gpu_windows(), H100_LONG_STEP_BUSY_100,
                         peers=H100_LONG_STEP_BUSY_50)
    views = with_metric(views, m.SM_CLOCK_MHZ, [H100_LONG_STEP_SM_MHZ_BUSY_100],
                        peers=[H100_LONG_STEP_SM_MHZ_BUSY_50])
    found = findings(views)
    assert {f.category for f in found} == {"gpu-compute"}
    # 0.4-0.47 in full windows; 0.5 in the last, which holds 6 readings (3 of them capped).
    assert all(0.35 <= f.evidence["throttled_excess_frac"] <= 0.5 for f in found)


def test_the_h100_clock_range_under_load_does_not_make_any_rank_throttled() -> None:
    views = with_reasons(slow_gpu_windows(), [H100_BUSY_REASONS], peers=[H100_BUSY_REASONS])
    views = with_metric(views, m.SM_CLOCK_MHZ, H100_BUSY_SM_MHZ, peers=H100_BUSY_SM_MHZ)
    assert categories(views) == {"gpu-compute"}


@pytest.mark.parametrize("reasons", [0x4 | 0x20, 0x4 | 0x40, 0x4 | 0x8, 0x4 | 0x80],
                         ids=["sw-thermal", "hw-thermal", "hw-slowdown", "power-brake"])
def test_a_thermal_or_hw_slowdown_among_power_capped_peers_is_throttling(reasons: int) -> None:
    views = with_reasons(slow_gpu_windows(), [reasons], peers=[H100_BUSY_REASONS])
    assert categories(views) == {"gpu-throttle"}


def test_only_the_suspect_power_capped_is_throttling_unless_its_load_explains_it() -> None:
    """At its cap while its peers are not: throttled when it is no busier than they are; the
    straggler (its SM utilisation above theirs, as the simulator reports it) reaches the cap
    by its own load, so it stays gpu-compute."""
    views = with_reasons(slow_gpu_windows(), [H100_BUSY_REASONS], peers=[H100_IDLE_REASONS])
    found = findings(views)
    assert {f.category for f in found} == {"gpu-compute"}
    assert all(f.evidence["sm_util_ratio"] >= BUSIER_UTIL_RATIO for f in found)
    as_busy = with_metric(views, m.SM_UTIL_PCT, [90.0], peers=[90.0])
    assert categories(as_busy) == {"gpu-throttle"}


@cache
def simulated_views(fault: str) -> tuple[WindowView, ...]:
    spec = ClusterSpec(steps=60, seed=11, dp=4, pp=2, tp=2, metric_interval_s=1.0)
    views: list[WindowView] = []
    pipeline = EmbeddedStreamJob([], window_s=15.0, on_window=lambda v, f: views.append(v))
    for records in SimulatedCluster(spec, parse_faults([fault])).batches():
        pipeline.process_records(records)
    pipeline.finish()
    return tuple(views)


def test_a_2x_slow_gpu_whose_peers_leave_their_power_cap_is_gpu_compute() -> None:
    """In the simulator the power cap follows utilisation: the 2x slow GPU computes ~89% of
    the step and is capped in every reading, its peers wait half of it and are capped in none.
    That is its load, not its GPU held back (issue 23): gpu-compute, by every detector."""
    views = simulated_views(f"slow-gpu:rank={SLOW},factor=2.0")
    shares = throttling_shares(views[1])
    assert shares.loc[SLOW, "sw_power_cap"] == 1.0
    assert shares.drop(index=SLOW)["sw_power_cap"].max() == 0.0
    for detector in (PeerDiffDetector(), MixtureDetector()):
        assert alert_categories(detector, list(views)) == {"gpu-compute"}, detector.name


def test_a_throttled_gpu_in_the_simulator_is_still_gpu_throttle() -> None:
    views = simulated_views(f"throttle:rank={SLOW}")
    assert alert_categories(PeerDiffDetector(), list(views)) == {"gpu-throttle"}
    assert alert_categories(MixtureDetector(), list(views)) == {"gpu-throttle"}


def test_a_lower_power_limit_than_the_peers_is_throttling() -> None:
    """Capped at 500 W while its peers are capped at 700 W: the same power-cap bit everywhere,
    but the limit itself differs."""
    capped = with_reasons(slow_gpu_windows(), [H100_BUSY_REASONS], peers=[H100_BUSY_REASONS])
    lower = with_added_metric(capped, m.POWER_LIMIT_W,
                              lambda r: 500.0 if r == SLOW else H100_POWER_LIMIT_W)
    assert categories(lower) == {"gpu-throttle"}
    same = with_added_metric(capped, m.POWER_LIMIT_W, lambda r: H100_POWER_LIMIT_W)
    assert categories(same) == {"gpu-compute"}


def test_idle_alongside_throttling_still_counts_and_a_rare_blip_does_not() -> None:
    both = with_reasons(slow_gpu_windows(), [0x1 | 0x40], peers=[0x0])
    assert categories(both) == {"gpu-throttle"}
    # One power-cap reading in ten: the OR over a window holding it would say "throttled"; per
    # reading, it is 10%, below the detector's threshold.
    blip = with_reasons(slow_gpu_windows(), [0x4] + [0x1] * 9, peers=[0x1])
    assert categories(blip) == {"gpu-compute"}


def test_the_agents_condensed_share_is_judged_per_reading_and_against_peers() -> None:
    """Readings through the host agent's window aggregation: the OR of the window holds the
    power cap, the share of throttled readings (1 in 5) stays below the threshold."""
    readings = [0x4, 0x1, 0x1, 0x0, 0x1]
    agg = WindowAggregator()
    agg.add([MetricSample(job_id="j", rank=SLOW, device=0, ts_ns=i, name=m.THROTTLE_REASONS,
                          value=float(r)) for i, r in enumerate(readings)])
    out = {r.name: r.value for r in agg.flush(0, 10) if isinstance(r, MetricSample)}
    assert out == {m.THROTTLE_REASONS: float(0x5), m.THROTTLED_FRAC: 0.2}
    views = []
    for v in with_reasons(slow_gpu_windows(), [0], peers=[0]):
        metrics = v.metrics[~((v.metrics["rank"] == SLOW)
                              & (v.metrics["name"] == m.THROTTLE_REASONS))]
        condensed = pd.DataFrame([
            {**metrics.iloc[0].to_dict(), "rank": SLOW, "name": name, "value": value}
            for name, value in out.items()
        ])
        views.append(dataclasses.replace(v, metrics=pd.concat([metrics, condensed],
                                                                  ignore_index=True)))
    assert categories(views) == {"gpu-compute"}
    # The OR is not taken for per-reason shares: only the condensed share is known.
    shares = throttling_shares(views[0])
    assert shares.loc[SLOW, "any"] == 0.2 and shares.loc[SLOW].drop("any").isna().all()
    heavy = [dataclasses.replace(v, metrics=v.metrics.assign(
        value=v.metrics["value"].where(v.metrics["name"] != m.THROTTLED_FRAC, 0.6)))
        for v in views]
    # Condensed, the share may be the power cap, which the straggler (busier than its peers)
    # reaches by its own load; it counts when the rank is no busier than they are.
    assert categories(heavy) == {"gpu-compute"}
    heavy = with_metric(heavy, m.SM_UTIL_PCT, [90.0], peers=[90.0])
    assert categories(heavy) == {"gpu-throttle"}
    # The same share is no excess when the peers are throttled as often.
    peers_too = with_reasons(heavy, [0], peers=[0x4, 0x4, 0x4, 0x0, 0x0])
    assert categories(peers_too) == {"gpu-compute"}


def alert_categories(detector, views: list[WindowView]) -> set[str]:
    return {f.category for v in views for f in detector.detect(v)
            if f.rank == SLOW and f.score >= 0.5}


def test_the_mixture_detector_does_not_call_the_busy_straggler_throttled() -> None:
    """Its SM clock 14% below its peers' (the H100's 1401 vs 1620 MHz) is what a GPU computing
    while its peers wait reads under the power cap they all report."""
    views = with_reasons(slow_gpu_windows(), [H100_BUSY_REASONS], peers=[H100_BUSY_REASONS])
    views = with_metric(views, m.SM_CLOCK_MHZ, [H100_MEAN_SM_MHZ_BUSY_100],
                        peers=[H100_MEAN_SM_MHZ_BUSY_70])
    assert alert_categories(MixtureDetector(), views) == {"gpu-compute"}


def test_the_mixture_detector_names_a_thermal_slowdown_among_power_capped_peers() -> None:
    views = with_reasons(slow_gpu_windows(), [0x4 | 0x40], peers=[H100_BUSY_REASONS])
    views = with_metric(views, m.SM_CLOCK_MHZ, [1200.0], peers=[H100_MEAN_SM_MHZ_BUSY_70])
    assert alert_categories(MixtureDetector(), views) == {"gpu-throttle"}
    # The same clocks with the power cap alone on every rank: a busy straggler, not throttled.
    capped = with_reasons(views, [H100_BUSY_REASONS], peers=[H100_BUSY_REASONS])
    assert alert_categories(MixtureDetector(), capped) == {"gpu-compute"}
