"""Each fault of the simulated cluster is pinned on the right rank (or stage) and cause."""

from __future__ import annotations

import pytest

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.detectors.diagnosis import diagnose
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults


def diagnose_run(faults: list[str], steps: int = 120, seed: int = 11, every_detector: bool = False,
                 send_tokens: bool = True, **layout: int):
    spec = ClusterSpec(steps=steps, seed=seed, send_tokens=send_tokens,
                       **({"dp": 4, "pp": 2, "tp": 2} | layout))
    pipeline = EmbeddedStreamJob(
        None if every_detector  # every built-in one, as `trainscope pipeline` runs them
        else [PeerDiffDetector(), StepTimeDetector(), RankAnomalyDetector()], window_s=15.0
    )
    for records in SimulatedCluster(spec, parse_faults(faults)).batches():
        pipeline.process_records(records)
    pipeline.finish()
    return diagnose(pipeline.findings), pipeline


@pytest.mark.parametrize(
    ("fault", "rank", "category"),
    [
        ("slow-gpu:rank=13,factor=1.4", 13, "gpu-compute"),
        ("throttle:rank=5,mhz=1300", 5, "gpu-throttle"),
        ("slow-link:rank=6,factor=3", 6, "network"),
        ("dataloader-stall:rank=9,ms=150", 9, "dataloader"),
        ("gc-pause:rank=3,ms=300,every=5", 3, "python-gc"),
    ],
)
def test_rank_faults_are_localised(fault: str, rank: int, category: str) -> None:
    suspects, _ = diagnose_run([fault])
    assert suspects, f"{fault}: no alert"
    top = suspects[0]
    assert (top.rank, top.category) == (rank, category), [s.as_json() for s in suspects]


@pytest.mark.parametrize(("every", "seed"), [(2, 23011), (5, 11)])
def test_gc_pauses_of_10_ms_per_step_are_found(every: int, seed: int) -> None:
    """Work the ranks hardly do: 10.5 ms per step on average is 1.3% of this job's 0.8-s step,
    within the step's noise floor for work every rank does, well above it for GC pauses. The
    first case was the fault sweep's one miss (seed 23): alerted in two windows at 0.52-0.53."""
    suspects, _ = diagnose_run(
        [f"gc-pause:rank=27,ms={int(10.5 * every)},every={every},start=58"], seed=seed,
        every_detector=True, dp=4, pp=2, tp=4)
    assert suspects, "no alert"
    assert (suspects[0].rank, suspects[0].category) == (27, "python-gc"), [
        s.as_json() for s in suspects]


def test_victims_are_named_and_are_not_suspects() -> None:
    suspects, _ = diagnose_run(["slow-gpu:rank=2,factor=1.5"])
    assert suspects[0].rank == 2
    assert suspects[0].victims, "the slow rank's TP/DP/PP peers wait on it"
    assert 2 not in suspects[0].victims
    assert all(s.rank == 2 for s in suspects if s.rank >= 0)


def test_stage_imbalance_names_the_stage() -> None:
    suspects, _ = diagnose_run(["stage-imbalance:stage=2,factor=1.3"], pp=4, dp=2)
    top = suspects[0]
    assert (top.category, top.pp_stage) == ("stage-imbalance", 2)
    assert sorted(top.ranks) == [8, 9, 10, 11]


def test_seq_imbalance_is_not_blamed_on_a_rank() -> None:
    suspects, _ = diagnose_run(["seq-imbalance"])
    assert suspects[0].category == "seq-imbalance"
    assert not [s for s in suspects if s.category in ("gpu-compute", "gpu-throttle")]


def test_fault_starting_mid_run_is_found_after_it_starts() -> None:
    suspects, pipeline = diagnose_run(["dataloader-stall:rank=4,ms=200,start=60"], steps=120)
    assert (suspects[0].rank, suspects[0].category) == (4, "dataloader")
    fault_start_ns = ClusterSpec().start_ns + 55 * 10**9  # step 60 is ~66 s in
    assert all(
        f.window_end_ns > fault_start_ns for f in pipeline.findings
        if f.rank == 4 and f.score >= 0.5
    )


def test_healthy_run_of_200_steps_raises_no_alert() -> None:
    suspects, pipeline = diagnose_run([], steps=200, seed=2)
    assert pipeline.windows >= 10
    assert suspects == [], [s.as_json() for s in suspects]
    assert all(f.score < 0.5 for f in pipeline.findings)


def test_healthy_larger_layout_raises_no_alert() -> None:
    suspects, _ = diagnose_run([], steps=200, seed=4, dp=8, pp=4, tp=2)
    assert suspects == [], [s.as_json() for s in suspects]


def test_job_slowdown_is_reported_once_it_persists() -> None:
    _, pipeline = diagnose_run(["slow-gpu:rank=6,factor=1.6,start=60"], steps=140)
    slowdowns = [f for f in pipeline.findings if f.category == "slowdown"]
    assert slowdowns, "a 1.6x slower GPU from step 60 slows the whole job"
    # Steps last more than a second, so step 60 starts more than 60 s into the job.
    assert all(f.window_end_ns > ClusterSpec().start_ns + 60 * 10**9 for f in slowdowns)
    assert all(f.score >= 0.5 and f.evidence["frac"] >= 0.1 for f in slowdowns)


def test_a_smaller_second_fault_is_named_beside_the_first() -> None:
    """Both stragglers delay the same collectives, so the GC pauses barely move the step while
    the slow GPU is there; they are still a fault of their own (sweep job 55)."""
    suspects, _ = diagnose_run(["slow-gpu:rank=14,factor=1.36,start=25",
                                "gc-pause:rank=5,ms=36,every=2,start=55"],
                               every_detector=True, seed=23055)
    named = {(s.rank, s.category) for s in suspects}
    assert {(14, "gpu-compute"), (5, "python-gc")} <= named, [s.as_json() for s in suspects]


def test_gc_pauses_beside_a_slow_link_are_named_with_their_own_late_sends() -> None:
    """The fault sweep's one two-fault miss (seed 29, job 54): rank 173's GC pauses (38-48 ms
    per step) beside a 3x slow link on rank 109. Rank 173 is also named for its late pipeline
    sends (+21 ms/step), the same straggler's: counted against its GC pauses, they held the
    GC finding's share of what the link leaves at 0.44-0.57, never a confirmed alert."""
    suspects, _ = diagnose_run(["gc-pause:rank=173,ms=191,every=5,start=46",
                                "slow-link:rank=109,factor=2.97,start=49"],
                               every_detector=True, seed=29054, dp=16, pp=4, tp=4)
    named = {(s.rank, s.category) for s in suspects}
    assert {(109, "network"), (173, "python-gc")} <= named, [s.as_json() for s in suspects]


@pytest.mark.parametrize("spread", [0.2, 0.4])
def test_seq_imbalance_from_spread_0_2_lists_no_innocent_rank(spread: float) -> None:
    """Every built-in detector: the ranks that drew the longest sequences are busier, which
    the metrics-only detectors once alerted as gpu-compute (8 ranks of one replica)."""
    suspects, _ = diagnose_run([f"seq-imbalance:spread={spread},start=30"], every_detector=True,
                               dp=4, pp=2, tp=4, seed=23041)
    assert [s.category for s in suspects] == ["seq-imbalance"], [s.as_json() for s in suspects]


@pytest.mark.parametrize(("spread", "dp", "pp", "tp"), [(0.2, 4, 2, 2), (0.3, 16, 4, 4)])
def test_imbalance_that_moves_is_named_from_timing_alone(
    spread: float, dp: int, pp: int, tp: int
) -> None:
    """No token counts in the step records: the imbalance is read from the DP groups' waits
    (each member waits on whichever is slowest that step), with its cost per step."""
    suspects, _ = diagnose_run([f"seq-imbalance:spread={spread},start=30"], every_detector=True,
                               send_tokens=False, dp=dp, pp=pp, tp=tp, seed=7)
    assert [s.category for s in suspects] == ["seq-imbalance"], [s.as_json() for s in suspects]
    assert suspects[0].detectors == {"waits"}
    assert suspects[0].evidence["wait_ns_per_step"] > 0.05 * suspects[0].evidence["step_ns"]


@pytest.mark.parametrize("fault", ["", "gc-pause:rank=3,ms=400,every=20,start=30",
                                   "slow-gpu:rank=5,factor=1.3,start=30"])
def test_no_token_counts_and_no_moving_imbalance_names_none(fault: str) -> None:
    """A healthy job, one rank that stalls now and then (its peers wait on it in those steps
    only) and a persistent straggler are not an imbalance that moves."""
    suspects, pipeline = diagnose_run([fault] if fault else [], every_detector=True,
                                      send_tokens=False, seed=7)
    assert not [f for f in pipeline.findings if f.category == "seq-imbalance"
                and f.score >= ALERT_THRESHOLD]
    if not fault:
        assert suspects == [], [s.as_json() for s in suspects]
