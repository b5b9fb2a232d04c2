"""The waits detector on windows shaped like a real DDP job's: who makes the others wait.

The windows are built the way a synchronous data-parallel step unfolds, not from hand-picked
figures: each step, every rank does its own (hooked) work and its unhooked host work, with
jitter; the all-reduce ends when the last rank has arrived plus the transfer, so a rank's
``ddp_allreduce`` time is its wait for the last arrival plus the transfer, and every rank's step
ends together. Summaries and step records are what the producer would send for that.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.contract import check_contract, contract_windows
from trainscope.detectors.diagnosis import diagnose
from trainscope.detectors.params import DetectorConfigError
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.registry import DetectorRunner
from trainscope.detectors.waits import WaitDetector
from trainscope.loop.policy import ProfilePolicy
from trainscope.schemas.records import Topology, WorkerInfo
from trainscope.schemas.window import STEP_COLUMNS, SUMMARY_COLUMNS, WindowView
from trainscope.testing import check_detector, sample_windows

MS = 1_000_000
STEPS = 60  # per 3 s window at ~50 ms steps
T0_NS = 1_767_225_600 * 10**9


def ddp_windows(
    count: int,
    world: int = 4,
    *,
    outside_ms: dict[int, float] | None = None,
    backward_extra_ms: dict[int, float] | None = None,
    everyone_outside_ms: float = 0.0,
    jitter_ms: float = 1.0,
    seed: int = 3,
    topology: Topology | None = None,
    collective: str = "ddp_allreduce",
    moving_ms: float = 0.0,
    moving_from: int = 0,
    stalls_ms: dict[int, dict[int, float]] | None = None,
    moving_runqueue: bool = False,
    runqueue_ms: float | None = None,
    runqueue_ms_of: dict[int, float] | None = None,
    agent_too: bool = False,
) -> list[WindowView]:
    """``count`` windows of a ``world``-rank synchronous job: per rank and step, forward ~8 ms,
    backward ~16 ms (plus ``backward_extra_ms``, and from window ``moving_from`` on up to
    ``moving_ms`` more on a member drawn at random each step: uneven data), unhooked host work
    ~5 ms (plus ``outside_ms`` and ``everyone_outside_ms``, and in every tenth step of window
    ``w`` ``stalls_ms[w][rank]`` more), each with ``jitter_ms`` of noise,
    then the all-reduce: 3 ms of transfer after the last rank arrives. Summaries carry each
    function's quickest call (``min_ns``) and spread (``m2_ns2``) as the producers' do.

    With ``moving_runqueue`` the moving extra is time a member waited for a CPU rather than
    more data; given ``runqueue_ms`` (or ``moving_runqueue``), each rank also sends its
    process's run-queue wait: ``runqueue_ms`` per step (plus ``runqueue_ms_of[rank]``), plus
    that extra; with ``agent_too`` the eBPF agent reports the same wait beside it."""
    rng = np.random.default_rng(seed)
    outside_ms, backward_extra_ms = outside_ms or {}, backward_extra_ms or {}
    stalls_ms = stalls_ms or {}
    windows = []
    for w in range(count):
        start = T0_NS + w * 3_000 * MS
        totals = {r: {"forward": 0.0, "backward": 0.0, "wait": 0.0, "pre": 0.0, "runq": 0.0}
                  for r in range(world)}
        mins = {r: dict.fromkeys(totals[r], np.inf) for r in range(world)}
        squares = {r: dict.fromkeys(totals[r], 0.0) for r in range(world)}
        steps, t = [], start
        for k in range(STEPS):
            jitter = lambda: max(rng.normal(0, jitter_ms), -2.0) * MS  # noqa: E731
            uneven = (rng.uniform(0, moving_ms, world) if w >= moving_from
                      else np.zeros(world))
            forward = {r: 8 * MS + jitter() for r in range(world)}
            backward = {r: (16 + backward_extra_ms.get(r, 0.0) + uneven[r]) * MS + jitter()
                        for r in range(world)}
            stalls = stalls_ms.get(w, {}) if k % 10 == 0 else {}
            host = {r: (5 + outside_ms.get(r, 0.0) + everyone_outside_ms
                        + stalls.get(r, 0.0)) * MS + jitter()
                    for r in range(world)}
            arrival = {r: forward[r] + backward[r] + host[r] for r in range(world)}
            done = max(arrival.values()) + 3 * MS
            for r in range(world):
                took = {"forward": forward[r], "backward": backward[r], "pre": 0.2 * MS,
                        "wait": done - arrival[r],
                        "runq": ((runqueue_ms or 0.0) + (runqueue_ms_of or {}).get(r, 0.0)
                                 + (uneven[r] if moving_runqueue else 0.0)) * MS}
                for key, ns in took.items():
                    totals[r][key] += ns
                    squares[r][key] += ns * ns
                    mins[r][key] = min(mins[r][key], ns)
                steps.append((r, w * STEPS + k, int(t), int(done), 16, 0, 0, 0, 0, 0))
            t += done
        rows = []
        functions = [("torch_op", "forward", "forward"), ("torch_op", "backward", "backward"),
                     ("collective", "ddp_pre_forward", "pre"), ("collective", collective, "wait")]
        if moving_runqueue or runqueue_ms is not None:
            functions.append(("sched", "process_runqueue_wait", "runq"))
            if agent_too:
                functions.append(("sched", "runqueue_wait", "runq"))
        for r, tot in totals.items():
            for layer, name, key in functions:
                m2 = max(squares[r][key] - tot[key] ** 2 / STEPS, 0.0)  # as the sketch keeps it
                rows.append((r, layer, name, 0, STEPS, int(tot[key]), m2, int(mins[r][key]), 0,
                             0))
        windows.append(WindowView(
            job_id="ddp-job", window_start_ns=start, window_end_ns=start + 3_000 * MS,
            summaries=pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS)),
            steps=pd.DataFrame(steps, columns=list(STEP_COLUMNS)),
            topology=topology,
        ))
    return windows


def run(detector, windows: list[WindowView]) -> list[list]:
    return [detector.detect(w) for w in windows]


def test_a_straggler_outside_the_hooks_is_named_with_the_wait_it_costs() -> None:
    per_window = run(WaitDetector(), ddp_windows(3, outside_ms={2: 30.0}))
    first, *confirmed = per_window
    assert [(f.rank, f.score) for f in first] == [(2, 0.45)]  # not yet confirmed
    for found in confirmed:
        finding, = found
        assert (finding.rank, finding.category, finding.detector) == (2, "host", "waits")
        assert finding.score >= ALERT_THRESHOLD
        assert (finding.layer, finding.function) == ("collective", "ddp_allreduce")
        assert finding.victims == [0, 1, 3]
        assert finding.evidence["peers_wait_ns_per_step"] == pytest.approx(30 * MS, rel=0.1)
        assert finding.evidence["outside_instrumented_ns_per_step"] == pytest.approx(
            30 * MS, rel=0.15)
        assert finding.evidence["own_excess_ns_per_step"] < 3 * MS
        assert "outside instrumented code" in finding.message
        assert "30 ms/step" in finding.message


def test_the_smallest_group_of_the_measured_job_three_ranks() -> None:
    """The job of the issue: 3 ranks, the peers ~10x the slow rank's all-reduce time."""
    *_, last = run(WaitDetector(), ddp_windows(2, world=3, outside_ms={1: 30.0}))
    finding, = last
    assert (finding.rank, finding.category, finding.victims) == (1, "host", [0, 2])
    assert finding.evidence["value_ns_per_step"] < finding.evidence["reference_ns_per_step"] / 5
    assert finding.score >= ALERT_THRESHOLD


def test_a_healthy_job_with_jitter_raises_nothing() -> None:
    detector = WaitDetector()
    for seed in range(3):
        for world in (3, 8):
            assert run(detector, ddp_windows(6, world=world, jitter_ms=3.0, seed=seed)) == \
                [[]] * 6


def test_a_job_wide_slowdown_names_no_rank() -> None:
    windows = ddp_windows(2, seed=5) + ddp_windows(4, everyone_outside_ms=30.0, seed=6)
    assert run(WaitDetector(), windows) == [[]] * 6


def test_two_stragglers_in_one_group_are_both_named() -> None:
    *_, last = run(WaitDetector(), ddp_windows(2, world=8, outside_ms={1: 25.0, 6: 25.0}))
    assert sorted((f.rank, f.category) for f in last) == [(1, "host"), (6, "host")]
    assert all(f.score >= ALERT_THRESHOLD for f in last)


def test_a_straggler_peer_diff_explains_is_not_alerted_twice() -> None:
    """Its own backward grew: peer-diff names the function; the wait is evidence here only."""
    windows = ddp_windows(4, outside_ms={}, backward_extra_ms={3: 30.0})
    waits = run(WaitDetector(), windows)
    assert all(f.rank == 3 and f.score <= 0.3 for found in waits for f in found)
    assert waits[-1], "the wait is still reported, as evidence"
    peer = run(PeerDiffDetector(), windows)
    suspects = diagnose([f for found in waits + peer for f in found])
    assert [(s.rank, s.function) for s in suspects] == [(3, "backward")], suspects


def test_tensor_parallel_groups_are_read_within_themselves() -> None:
    """2 DP replicas x 4 TP ranks: only the late rank's TP peers wait, in ``all_reduce[tp]``."""
    workers = [WorkerInfo(rank=r, dp_rank=r // 4, tp_rank=r % 4) for r in range(8)]
    topology = Topology(job_id="ddp-job", dp_size=2, tp_size=4, workers=workers)
    # Each TP group is its own synchronous group: simulate both and stack their ranks.
    groups = [ddp_windows(2, world=4, outside_ms={1: 30.0} if g == 1 else {}, seed=g,
                          collective="all_reduce[tp]") for g in range(2)]
    windows = []
    for w in range(2):
        parts = [groups[g][w] for g in range(2)]
        shift = lambda frame, g: frame.assign(rank=frame["rank"] + 4 * g)  # noqa: E731
        windows.append(WindowView(
            job_id="ddp-job", window_start_ns=parts[0].window_start_ns,
            window_end_ns=parts[0].window_end_ns, topology=topology,
            summaries=pd.concat([shift(v.summaries[v.summaries["name"] != "ddp_pre_forward"], g)
                                 for g, v in enumerate(parts)], ignore_index=True),
            steps=pd.concat([shift(v.steps, g) for g, v in enumerate(parts)], ignore_index=True),
        ))
    *_, last = run(WaitDetector(), windows)
    finding, = last
    assert (finding.rank, finding.function, finding.victims) == (5, "all_reduce[tp]", [4, 6, 7])
    assert "TP group" in finding.message and finding.score >= ALERT_THRESHOLD


def test_a_bad_setting_is_one_clear_error() -> None:
    with pytest.raises(DetectorConfigError, match="waits: z_min must be > 0, got -1"):
        WaitDetector(z_min=-1)
    with pytest.raises(DetectorConfigError, match="waits: confirm_windows"):
        WaitDetector(confirm_windows=0)


def test_it_passes_the_detector_contract() -> None:
    """Picklable (checkpoints), deterministic, never mutating its input, on both sets of
    synthetic windows the other built-ins are held to."""
    check_detector(WaitDetector, sample_windows())
    check_contract(WaitDetector, contract_windows())


def test_the_closed_loop_profiles_a_host_finding_against_a_peer_it_does_not_name() -> None:
    windows = ddp_windows(2, world=4, outside_ms={2: 30.0})
    detector = WaitDetector()
    detector.detect(windows[0])
    findings = detector.detect(windows[1])
    plan, = ProfilePolicy(clock=lambda: 0.0).decide(windows[1], findings, pending=0)
    assert (plan.suspect, plan.finding.category) == (2, "host")
    assert plan.peer != 2  # every other rank waits on it; the nearest one is the reference


def test_a_rank_late_because_it_waited_elsewhere_is_a_victim_not_named() -> None:
    """DP group of 4 whose rank 1 arrives ~30 ms late to ``ddp_allreduce`` only because it first
    waited ~30 ms in ``all_reduce[tp]`` for a TP partner outside this window's data: the
    straggler is that partner, not rank 1."""
    windows = ddp_windows(3, outside_ms={1: 30.0})
    shifted = []
    for view in windows:
        tp = view.summaries[view.summaries["name"] == "ddp_pre_forward"].assign(
            name="all_reduce[tp]",
            total_ns=lambda f: (f["rank"] == 1) * 30 * MS * STEPS + 1 * MS * STEPS)
        shifted.append(WindowView(
            job_id=view.job_id, window_start_ns=view.window_start_ns,
            window_end_ns=view.window_end_ns, steps=view.steps,
            summaries=pd.concat([view.summaries, tp], ignore_index=True)))
    assert run(WaitDetector(), shifted) == [[]] * 3
    # The same lateness without the wait elsewhere is named (the control).
    assert [f.rank for f in run(WaitDetector(), windows)[-1]] == [1]


def test_an_imbalance_that_moves_is_named_for_the_job_with_its_cost() -> None:
    """From the third window, one member drawn at random each step computes up to 30 ms more
    (uneven data, no token counts): no rank is late on average, every rank waits. Alerted from
    its second window (confirmed as a late rank is)."""
    per_window = run(WaitDetector(), ddp_windows(5, world=8, moving_ms=30.0, moving_from=2))
    assert per_window[:2] == [[], []]
    pending = [(f.category, f.score) for f in per_window[2]]
    assert pending == [("seq-imbalance", 0.45)]  # not yet confirmed
    for found in per_window[3:]:
        finding, = (f for f in found if f.score >= ALERT_THRESHOLD)  # the only alert
        assert (finding.rank, finding.category, finding.function) == (
            -1, "seq-imbalance", "ddp_allreduce")
        assert finding.ranks == list(range(8)) and finding.score >= ALERT_THRESHOLD
        # Expected wait: E[max of 8 uniform(0, 30)] - E[uniform(0, 30)] = 26.7 - 15 ms.
        assert finding.evidence["wait_ns_per_step"] == pytest.approx(11.7 * MS, rel=0.35)


def test_ranks_taking_turns_waiting_for_a_cpu_are_contention_not_uneven_data() -> None:
    """The same turns, but each member's extra time is its training thread waiting for a CPU
    (the kernel's run-queue wait, which the producer sends): the host is oversubscribed. Named
    for the job as ``cpu-contention``, with the wait per step, never as uneven data."""
    per_window = run(WaitDetector(), ddp_windows(5, world=4, moving_ms=30.0, moving_from=2,
                                                 moving_runqueue=True, runqueue_ms=0.05))
    assert per_window[:2] == [[], []]
    for found in per_window[3:]:
        finding, = (f for f in found if f.score >= ALERT_THRESHOLD)
        assert (finding.rank, finding.category) == (-1, "cpu-contention"), finding.message
        assert "waiting for a CPU" in finding.message
        # Each member waits ~15 ms/step for a CPU (the mean of uniform(0, 30)).
        assert finding.evidence["runqueue_wait_ns_per_step"] == pytest.approx(15 * MS, rel=0.2)


def test_contention_is_judged_over_the_run_not_flipped_by_one_quieter_window() -> None:
    """Ranks taking turns waiting for a CPU for six windows, then the same turns from uneven
    data with next to no run-queue wait: the first window of data is still read as contention
    (a contended host's waits come in bursts; one window showing little of them does not make
    it uneven data), and once the run's last four windows are all data it is ``seq-imbalance``."""
    contended = ddp_windows(12, world=4, moving_ms=30.0, moving_from=2, moving_runqueue=True,
                            runqueue_ms=0.05)
    uneven = ddp_windows(12, world=4, moving_ms=30.0, moving_from=2, runqueue_ms=0.05, seed=4)
    per_window = run(WaitDetector(), contended[:6] + uneven[6:])
    categories = [[f.category for f in found if f.score >= ALERT_THRESHOLD]
                  for found in per_window]
    assert categories[3:7] == [["cpu-contention"]] * 4, categories
    assert categories[10:] == [["seq-imbalance"]] * 2, categories
    # The evidence gives what was judged, the run's last windows, and this window's own.
    evidence = per_window[6][0].evidence
    assert evidence["runqueue_windows"] == 4
    assert evidence["window_runqueue_wait_ns_per_step"] < 0.1 * MS
    assert evidence["runqueue_wait_ns_per_step"] == pytest.approx(15 * MS * 3 / 4, rel=0.25)


def test_a_rank_late_for_want_of_a_cpu_is_named_once_for_it() -> None:
    """Rank 2's host work takes 30 ms more because it waits 30 ms/step for a CPU (a busy
    neighbour on its core), and both the producer and the agent report that wait: peer-diff
    names it cpu-contention once, from the agent's figure, and the waits detector counts it
    once as the rank's own work (not 60 ms for a 30 ms wait)."""
    windows = ddp_windows(4, outside_ms={2: 30.0}, runqueue_ms=0.5, runqueue_ms_of={2: 30.0},
                          agent_too=True)
    peer, waits = PeerDiffDetector(), WaitDetector()
    for window in windows:
        found_peer, found_waits = peer.detect(window), waits.detect(window)
    named = [(f.rank, f.category, f.function) for f in found_peer if f.score >= ALERT_THRESHOLD]
    assert named == [(2, "cpu-contention", "runqueue_wait")], named
    late, = found_waits
    assert late.rank == 2 and late.score < ALERT_THRESHOLD  # explained: peer-diff names it
    assert late.evidence["own_excess_ns_per_step"] == pytest.approx(30 * MS, rel=0.1)


def test_a_rank_that_waited_for_a_cpu_but_held_nobody_up_is_not_alerted() -> None:
    """Rank 1 waits 4 ms/step more for a CPU than its peers (a busy host: another job's
    processes on its core), yet reaches every all-reduce in time: no peer waits on it, so
    peer-diff keeps its cpu-contention as evidence; the same wait that makes it late is an
    alert."""
    windows = ddp_windows(4, runqueue_ms=0.5, runqueue_ms_of={1: 4.0})
    peer = PeerDiffDetector()
    for window in windows:
        found = peer.detect(window)
    (contention,) = [f for f in found if f.category == "cpu-contention"]
    assert contention.rank == 1 and contention.victims == [], contention
    assert 0 < contention.score < ALERT_THRESHOLD, contention
    late = ddp_windows(4, outside_ms={1: 4.0}, runqueue_ms=0.5, runqueue_ms_of={1: 4.0})
    peer = PeerDiffDetector()
    for window in late:
        found = peer.detect(window)
    alerted = [(f.rank, f.category) for f in found if f.score >= ALERT_THRESHOLD]
    assert alerted == [(1, "cpu-contention")], found


def test_uneven_data_on_a_busy_host_is_still_uneven_data() -> None:
    """Uneven data where every thread also waits ~1 ms per step for a CPU (a busy host, the
    same on every rank): the run-queue wait is far too small to explain the turns."""
    per_window = run(WaitDetector(), ddp_windows(5, world=8, moving_ms=30.0, moving_from=2,
                                                 runqueue_ms=1.0))
    for found in per_window[3:]:
        finding, = (f for f in found if f.score >= ALERT_THRESHOLD)
        assert finding.category == "seq-imbalance", finding.message
        assert finding.evidence["runqueue_wait_ns_per_step"] == pytest.approx(1 * MS, rel=0.01)


@pytest.mark.parametrize("jitter_ms", [1.0, 3.0, 6.0])
def test_jitter_of_every_rank_is_not_an_imbalance_that_moves(jitter_ms: float) -> None:
    """Every rank waits on whichever the jitter made slowest, from the first window on: that is
    the job's own level, not an imbalance rising from it."""
    for seed in range(3):
        assert run(WaitDetector(), ddp_windows(6, world=8, jitter_ms=jitter_ms, seed=seed)) \
            == [[]] * 6


@pytest.mark.parametrize("stall_ms", [150.0, 250.0])
def test_a_straggler_whose_peer_stalls_now_and_then_is_no_imbalance_that_moves(
        stall_ms: float) -> None:
    """Rank 2 is 50 ms late in every step; from the third window, rank 1 stalls ``stall_ms`` in
    every tenth step (as while the closed loop profiles it, or on a loaded host). Every member
    then waits in some calls, rank 2 too, and each one's calls spread: an imbalance that moves
    by the per-call test alone. It is not one: rank 2 spends far less in the all-reduce than
    the others, late on average by more than what they wait. A real 4-rank job in
    tests/test_operators_day.py alerted this as seq-imbalance before."""
    for seed in range(3):
        per_window = run(WaitDetector(), ddp_windows(
            6, world=4, outside_ms={2: 50.0}, jitter_ms=3.0, seed=seed,
            stalls_ms={w: {1: stall_ms} for w in (2, 3, 4)}))
        assert all(f.category != "seq-imbalance" for found in per_window for f in found)
        assert all(any(f.rank == 2 and f.score >= ALERT_THRESHOLD for f in found)
                   for found in per_window[1:])


# Measured: ``ddp_allreduce`` of the 4-rank gloo job of tests/test_operators_day.py (rank 2
# sleeps 50 ms in its forward every step) on a loaded 2-core host, 3-s windows; per window and
# rank: calls (one per step), mean ms, quickest call ms, standard deviation ms. In the fourth
# and fifth windows the closed loop profiled ranks 1 and 2, and everyone's calls spread.
MEASURED_STRAGGLER_UNDER_LOAD = [
    [(30, 56.56, 43.52, 4.658), (30, 56.40, 48.43, 4.214), (30, 6.600, 1.603, 3.482),
     (30, 56.99, 52.14, 3.640)],
    [(51, 57.11, 50.43, 3.061), (51, 56.91, 50.22, 3.427), (51, 6.418, 1.811, 2.699),
     (51, 57.06, 48.48, 3.318)],
    [(52, 56.25, 50.91, 3.563), (52, 56.32, 50.68, 3.075), (52, 5.802, 1.750, 2.477),
     (52, 56.32, 51.64, 2.867)],
    [(45, 69.43, 38.51, 38.79), (45, 68.87, 25.92, 38.66), (45, 16.44, 1.536, 37.03),
     (45, 69.89, 39.60, 39.70)],
    [(41, 65.12, 35.65, 26.13), (41, 65.58, 36.76, 26.87), (41, 14.33, 1.473, 24.74),
     (41, 65.12, 37.48, 26.06)],
]


def test_a_measured_straggler_on_a_loaded_host_is_no_imbalance_that_moves() -> None:
    """The measured windows above: rank 2 is named, and nothing moves. Before the straggler
    test in detectors/moving.py, the fourth and fifth windows were alerted as seq-imbalance."""
    windows = []
    for w, per_rank in enumerate(MEASURED_STRAGGLER_UNDER_LOAD):
        start = T0_NS + w * 3_000 * MS
        rows, steps = [], []
        for r, (count, mean_ms, min_ms, sd_ms) in enumerate(per_rank):
            rows.append((r, "collective", "ddp_allreduce", 0, count, int(count * mean_ms * MS),
                         count * (sd_ms * MS) ** 2, int(min_ms * MS), 0, 0))
            step_ns = 3_000 * MS // count
            steps += [(r, k, start + k * step_ns, step_ns, 16, 0, 0, 0, 0, 0) for k in range(count)]
        windows.append(WindowView(
            job_id="ddp-job", window_start_ns=start, window_end_ns=start + 3_000 * MS,
            summaries=pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS)),
            steps=pd.DataFrame(steps, columns=list(STEP_COLUMNS))))
    per_window = run(WaitDetector(), windows)
    assert [[(f.rank, f.category) for f in found if f.score >= ALERT_THRESHOLD]
            for found in per_window[1:]] == [[(2, "host")]] * 4
    assert all(f.category != "seq-imbalance" for found in per_window for f in found)


def test_device_collective_times_say_who_arrived_last_on_the_gpu() -> None:
    # NCCL: the host's call returns once the collective is queued (the same launch time on
    # every rank); on the device, the ranks wait in it for the last to arrive, rank 2.
    def nccl(view: WindowView) -> WindowView:
        s = view.summaries
        wait = s["layer"] == "collective"
        device = s[wait].assign(layer="gpu_collective")
        host = s.copy()
        host.loc[wait, "total_ns"] = host.loc[wait, "count"] * MS // 10
        host.loc[wait, "min_ns"] = MS // 10
        host.loc[wait, "m2_ns2"] = 0.0
        return dataclasses.replace(view, summaries=pd.concat([host, device], ignore_index=True))

    windows = [nccl(v) for v in ddp_windows(3, outside_ms={2: 30.0})]
    runner = DetectorRunner([WaitDetector()])
    alerts = [f for v in windows for f in runner.run(v) if f.score >= 0.5]
    assert alerts and {(f.rank, f.category) for f in alerts} == {(2, "host")}, alerts
    assert alerts[-1].evidence["peers_wait_ns_per_step"] > 20 * MS
    # On the host clock alone nobody waits: the device times are what names rank 2.
    host_only = [dataclasses.replace(v, summaries=v.summaries[
        v.summaries["layer"] != "gpu_collective"]) for v in windows]
    runner = DetectorRunner([WaitDetector()])
    assert not [f for v in host_only for f in runner.run(v) if f.score >= 0.5]
