"""The early flag (detectors/early.py): a straggler named from step records within a few steps
of its onset, before its window closes, and nothing raised on a healthy job or on imbalance
that moves from rank to rank."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from trainscope.detectors.diagnosis import diagnose
from trainscope.detectors.early import RECENT_STEPS, EarlyWatch
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas import metrics as m
from trainscope.schemas.records import Finding, MetricSample, StepRecord

WINDOW_S = 15.0


# What an NCCL call costs the host: its launch, whoever waits on the device.
NCCL_LAUNCH_NS = 40_000
# Two events around a call that queues nothing on the GPU: next to nothing between them.
GPU_EVENT_PAIR_NS = 5_000


def _as_sent(step: StepRecord, clock: str) -> StepRecord:
    """The simulated step record as a producer with collectives timed on ``clock`` sends it:
    ``host`` (gloo, or any blocking call), ``none`` (no collective timed), ``nccl`` (the host
    sees launches only; the waiting is on the device's clock), ``nccl-host-only`` (the same
    job without device times: what the early flag read on NCCL before), ``cuda-gloo`` (a
    CUDA job whose collectives run through gloo on CPU tensors: the waiting is on the host's
    clock, the device's events see nothing)."""
    if clock == "host":
        return step
    if clock == "none":
        return msgspec.structs.replace(step, collective_ns=0)
    if clock == "cuda-gloo":  # CPU tensors through gloo in a CUDA job: nothing on the GPU
        return msgspec.structs.replace(
            step, device_collective_ns=GPU_EVENT_PAIR_NS if step.collective_ns else 0)
    launches = NCCL_LAUNCH_NS if step.collective_ns else 0
    device_ns = step.collective_ns if clock == "nccl" else 0
    return msgspec.structs.replace(step, collective_ns=launches, device_collective_ns=device_ns)


def _run(faults: list[str], *, steps: int = 60, seed: int = 3, timed: bool = True,
         layout: tuple[int, int, int] = (4, 2, 2), clock: str = "host"
         ) -> tuple[EmbeddedStreamJob, dict[int, set[int]]]:
    """The job through the embedded stream job; returns it and, per step, the windows (their
    start) that had closed when that step's records had been handed over. ``clock``: see
    :func:`_as_sent` (``timed=False`` is ``none``)."""
    clock = clock if timed else "none"
    dp, pp, tp = layout
    spec = ClusterSpec(dp=dp, pp=pp, tp=tp, steps=steps, seed=seed, window_s=WINDOW_S)
    closed: set[int] = set()
    job = EmbeddedStreamJob(None, window_s=WINDOW_S,
                            on_window=lambda view, _: closed.add(view.window_start_ns))
    cluster = SimulatedCluster(spec, parse_faults(faults))
    job.process_records(cluster.topology_records())
    closed_at_step: dict[int, set[int]] = {}
    for output in cluster.run():
        records = [_as_sent(s, clock) for s in output.steps]
        job.process_records([*output.summaries, *records, *output.metrics])
        closed_at_step[output.step] = set(closed)
    job.finish()
    return job, closed_at_step


def _early(job: EmbeddedStreamJob) -> list[Finding]:
    return [f for f in job.findings if f.detector == "early"]


@pytest.mark.parametrize("fault", [
    "slow-gpu:rank=5,factor=1.4,start=30",
    "slow-gpu:rank=12,factor=2.0,start=25",
    "dataloader-stall:rank=3,ms=250,start=30",
])
def test_a_straggler_is_flagged_within_a_few_steps_of_its_onset(fault: str) -> None:
    job, _ = _run([fault])
    parsed = parse_faults([fault])[0]
    early = _early(job)
    assert len(early) == 1, [f.message for f in early]
    flag = early[0]
    assert (flag.rank, flag.category) == (parsed["rank"], "straggler"), flag
    assert flag.ranks == [parsed["rank"]] and flag.score >= 0.5, flag
    flagged_step = int(flag.evidence["step"])
    assert parsed.start + RECENT_STEPS - 1 <= flagged_step <= parsed.start + RECENT_STEPS + 2
    assert "made the peers wait" in flag.message and f"rank {parsed['rank']}" in flag.message
    assert f"steps {parsed.start}–{flagged_step}" in flag.message, flag.message
    # The window detectors then say why, and the diagnosis shows the cause, not the flag.
    suspects = diagnose(job.findings)
    assert suspects[0].rank == parsed["rank"] and suspects[0].category != "straggler"
    assert not [s for s in suspects if s.category == "straggler"], suspects


def test_the_flag_comes_before_its_window_closes() -> None:
    # The onset at step 30 of ~0.8-s steps (about 24 s in): the flag's window closes later.
    job, closed_at_step = _run(["slow-gpu:rank=5,factor=1.6,start=30"])
    flag = _early(job)[0]
    assert flag.window_start_ns <= flag.evidence["flagged_at_ns"] < flag.window_end_ns
    # When the flag was raised, its window (and every later one) was still open.
    closed_then = closed_at_step[int(flag.evidence["step"])]
    assert closed_then and max(closed_then) < flag.window_start_ns, (closed_then, flag)


def test_a_healthy_job_raises_no_flag() -> None:
    for seed in (3, 4, 5):
        job, _ = _run([], steps=90, seed=seed, layout=(4, 2, 4))
        assert not _early(job), [f.message for f in _early(job)]


def test_imbalance_that_moves_from_rank_to_rank_is_not_a_straggler() -> None:
    job, _ = _run(["seq-imbalance:spread=0.4,start=30"], steps=90)
    assert not [f for f in _early(job) if f.rank >= 0], [f.message for f in _early(job)]


def test_without_collective_times_no_rank_is_named_early() -> None:
    # Step records that do not say who waited (a producer that times no collective): even a
    # 3x slow GPU is left to the window detectors, which name it from its functions.
    job, _ = _run(["slow-gpu:rank=5,factor=3.0,start=30"], timed=False)
    assert not _early(job), [f.message for f in _early(job)]
    assert diagnose(job.findings)[0].rank == 5


@pytest.mark.parametrize("fault", [
    "slow-gpu:rank=5,factor=1.4,start=30",
    "dataloader-stall:rank=3,ms=250,start=30",
])
def test_on_nccl_the_straggler_is_named_from_the_device_clock(fault: str) -> None:
    """An NCCL job: every rank's host sees only launches (the same few µs whoever waits);
    the step records' device collective time shows the peers waiting. Named from that as a
    gloo job is from its host times; from the host times alone, no rank could be."""
    parsed = parse_faults([fault])[0]
    job, _ = _run([fault], clock="nccl")
    early = _early(job)
    assert [(f.rank, f.category) for f in early] == [(parsed["rank"], "straggler")], \
        [f.message for f in early]
    flagged_step = int(early[0].evidence["step"])
    assert parsed.start + RECENT_STEPS - 1 <= flagged_step <= parsed.start + RECENT_STEPS + 2
    blind, _ = _run([fault], clock="nccl-host-only")
    assert not [f for f in _early(blind) if f.rank >= 0], [f.message for f in _early(blind)]


def test_on_a_cuda_job_waiting_seen_on_the_host_only_still_counts() -> None:
    """A CUDA job's collectives through gloo on CPU tensors: their device times are next to
    nothing and the host saw the waiting; the larger of the two clocks is read."""
    job, _ = _run(["slow-gpu:rank=5,factor=1.4,start=30"], clock="cuda-gloo")
    assert [(f.rank, f.category) for f in _early(job)] == [(5, "straggler")], \
        [f.message for f in _early(job)]


def _steps(step: int, durations_ms: list[float], waits_ms: list[float]) -> list[StepRecord]:
    return [StepRecord(job_id="j", rank=r, step=step, start_ns=step * 10**9,
                       duration_ns=int(d * 1e6), collective_ns=int(w * 1e6))
            for r, (d, w) in enumerate(zip(durations_ms, waits_ms, strict=True))]


def test_a_flag_needs_every_rank_of_the_step_and_is_raised_once() -> None:
    watch = EarlyWatch(window_ns=15 * 10**9)
    for step in range(12):
        watch.add(_steps(step, [400] * 8, [20] * 8))
    assert watch.check() == []
    for step in range(12, 12 + RECENT_STEPS):
        # Rank 6 is late: its step grew by 160 ms, its peers waited those 160 ms for it.
        watch.add(_steps(step, [560] * 8, [180] * 6 + [20, 180]))
        # One rank's record not in yet: the step is not complete, nothing to decide.
    watch.add([s for s in _steps(12 + RECENT_STEPS, [560] * 8, [180] * 6 + [20, 180])
               if s.rank != 0])
    flags = watch.check()
    assert [(f.rank, f.category) for f in flags] == [(6, "straggler")], flags
    assert flags[0].evidence["step"] == 12 + RECENT_STEPS - 1
    # The same straggler, steps on: not flagged again (the windows carry it from here).
    for step in range(12 + RECENT_STEPS, 30):
        watch.add(_steps(step, [560] * 8, [180] * 6 + [20, 180]))
    assert watch.check() == []


def _stall(ts_s: float, waits_s: list[float | None], open_s: float = 5.0) -> list[MetricSample]:
    """Each rank's stall report at ``ts_s``; None: the rank reports nothing."""
    out = []
    for rank, wait_s in enumerate(waits_s):
        if wait_s is None:
            continue
        out += [MetricSample(job_id="j", rank=rank, ts_ns=int(ts_s * 1e9), name=m.STEP_OPEN_S,
                             value=open_s),
                MetricSample(job_id="j", rank=rank, ts_ns=int(ts_s * 1e9),
                             name=m.COLLECTIVE_WAIT_S, value=wait_s)]
    return out


def _stepping(watch: EarlyWatch, steps: range) -> None:
    for step in steps:
        watch.add(_steps(step, [100] * 8, [20] * 8))


def test_a_stall_names_the_rank_the_others_wait_for_once() -> None:
    watch = EarlyWatch(window_ns=15 * 10**9)
    _stepping(watch, range(12))
    assert watch.check() == []
    # Rank 5 is in its own code; its seven peers have waited 4 s in a collective.
    watch.add_metrics(_stall(100.0, [4.0] * 5 + [0.0] + [4.0] * 2))
    flags = watch.check()
    assert [(f.rank, f.category, f.victims) for f in flags] == [
        (5, "hang", [0, 1, 2, 3, 4, 6, 7])], flags
    assert "rank 5 stalled" in flags[0].message and "7 of 8 ranks wait" in flags[0].message
    # Later reports of the same stall raise nothing more ...
    watch.add_metrics(_stall(100.5, [4.5] * 5 + [0.0] + [4.5] * 2, open_s=5.5))
    assert watch.check() == []
    # ... until steps end again and another stall comes. Rank 0 sends nothing: its report
    # may be a round late, so it is called silent only once its peers have waited 2 s more.
    _stepping(watch, range(12, 14))
    watch.add_metrics(_stall(200.0, [None] + [4.0] * 7))
    assert watch.check() == []
    watch.add_metrics(_stall(202.0, [None] + [6.0] * 7))
    flags = watch.check()
    assert [(f.rank, f.evidence["silent"]) for f in flags] == [(0, 1.0)], flags
    assert "report nothing" in flags[0].message


def test_ranks_all_busy_in_their_own_code_are_no_stall() -> None:
    # An evaluation pass, a checkpoint every rank writes: every step open, nobody waiting.
    watch = EarlyWatch(window_ns=15 * 10**9)
    _stepping(watch, range(12))
    watch.check()
    watch.add_metrics(_stall(100.0, [0.0] * 8, open_s=30.0))
    assert watch.check() == []
    # Half the job held by the other half is no single rank's stall either.
    watch.add_metrics(_stall(101.0, [4.0] * 4 + [0.0] * 4, open_s=31.0))
    assert watch.check() == []


def test_a_rank_slowed_by_its_own_profile_is_not_flagged() -> None:
    """trainscope's on-demand profile of a rank slows it (the profiler's stop, condensing its
    events under the GIL): the rank's report of it (``profiler_busy_s``) keeps the flag quiet;
    the same steps without the report are flagged."""
    def run(profiled: bool) -> list[Finding]:
        watch = EarlyWatch(window_ns=15 * 10**9)
        for step in range(12):
            watch.add(_steps(step, [400] * 8, [20] * 8))
        assert watch.check() == []
        for step in range(12, 13 + RECENT_STEPS):
            if profiled:
                watch.add_metrics([MetricSample(job_id="j", rank=6, ts_ns=step * 10**9,
                                                name=m.PROFILER_BUSY_S, value=0.5)])
            watch.add(_steps(step, [560] * 8, [180] * 6 + [20, 180]))
        return watch.check()

    assert [(f.rank, f.category) for f in run(profiled=False)] == [(6, "straggler")]
    assert run(profiled=True) == []


def _profiled(ts_s: float, rank: int) -> list[MetricSample]:
    return [MetricSample(job_id="j", rank=rank, ts_ns=int(ts_s * 1e9), name=m.PROFILER_BUSY_S,
                         value=0.4)]


@pytest.mark.parametrize("profiled", [False, True])
def test_a_rank_held_by_its_own_profile_is_no_hang(profiled: bool) -> None:
    """trainscope's profile of a busy Python loop can hold its rank for seconds, its sender
    starved: a rank that reported its profile just before it went silent is not flagged while
    its peers wait; the same stall without that report is."""
    watch = EarlyWatch(window_ns=15 * 10**9)
    _stepping(watch, range(12))
    watch.check()
    if profiled:
        watch.add_metrics(_profiled(98.5, rank=5))
    watch.add_metrics(_stall(100.0, [4.0] * 5 + [None] + [4.0] * 2, open_s=4.0))
    watch.add_metrics(_stall(102.5, [6.5] * 5 + [None] + [6.5] * 2, open_s=6.5))
    flags = watch.check()
    assert [(f.rank, f.category) for f in flags] == ([] if profiled else [(5, "hang")]), flags


def test_a_stall_that_outlasts_the_profile_is_a_hang() -> None:
    """The rank speaks again without its profile and stays stalled: flagged once its last
    profile report is STALL_WAIT_S + SILENT_GRACE_S old; a rank silent for a minute likewise."""
    watch = EarlyWatch(window_ns=15 * 10**9)
    _stepping(watch, range(12))
    watch.check()
    watch.add_metrics(_profiled(98.5, rank=5))
    watch.add_metrics(_stall(102.5, [6.5] * 5 + [0.0] + [6.5] * 2, open_s=6.5))
    assert watch.check() == []  # it reported its profile 4 s ago
    watch.add_metrics(_stall(104.0, [8.0] * 5 + [0.0] + [8.0] * 2, open_s=8.0))
    assert [(f.rank, f.category) for f in watch.check()] == [(5, "hang")]

    silent = EarlyWatch(window_ns=15 * 10**9)
    _stepping(silent, range(12))
    silent.check()
    silent.add_metrics(_profiled(98.5, rank=5))
    silent.add_metrics(_stall(130.0, [30.0] * 5 + [None] + [30.0] * 2, open_s=30.0))
    assert silent.check() == []
    silent.add_metrics(_stall(160.0, [60.0] * 5 + [None] + [60.0] * 2, open_s=60.0))
    assert [(f.rank, f.category) for f in silent.check()] == [(5, "hang")]


def test_a_straggler_is_flagged_while_its_peers_take_turns_being_late() -> None:
    """On a busy host a peer is preempted now and then and reaches the collective late too;
    the straggler, late in every step, is still named, judged over the recent steps."""
    watch = EarlyWatch(window_ns=15 * 10**9)
    for step in range(12):
        watch.add(_steps(step, [400] * 8, [20] * 8))
    assert watch.check() == []
    for step in range(12, 12 + 3 * RECENT_STEPS):
        waits = [180] * 8
        waits[6] = 20  # the straggler
        waits[step % 6] = 20  # one peer after another, late as well
        watch.add(_steps(step, [560] * 8, waits))
    flags = watch.check()
    assert [(f.rank, f.ranks, f.category) for f in flags] == [(6, [6], "straggler")], flags


def test_a_straggler_run_broken_by_a_step_of_host_noise_is_still_flagged() -> None:
    """On a busy host one step of the straggler's run can come in under the bar (the job's
    other work preempted less that step); the run goes on, it is not a new onset to wait for."""
    watch = EarlyWatch(window_ns=15 * 10**9)
    for step in range(12):
        watch.add(_steps(step, [400] * 8, [20] * 8))
    slow = [560] * 8, [180] * 6 + [20, 180]
    watch.add(_steps(12, *slow))
    watch.add(_steps(13, [420] * 8, [40] * 8))  # not slow enough to count
    for step in range(14, 14 + RECENT_STEPS):
        watch.add(_steps(step, *slow))
    flags = watch.check()
    assert [(f.rank, f.category) for f in flags] == [(6, "straggler")], flags
    assert "steps 12–" in flags[0].message, flags[0].message


def test_a_run_of_slow_steps_ends_after_as_many_steps_that_are_not() -> None:
    """Slow steps a few at a time, each burst followed by RECENT_STEPS ordinary ones, are
    bursts of host noise, never one run long enough to flag."""
    watch = EarlyWatch(window_ns=15 * 10**9)
    for step in range(12):
        watch.add(_steps(step, [400] * 8, [20] * 8))
    for burst in range(4):
        first = 12 + burst * (2 * RECENT_STEPS - 1)
        for step in range(first, first + RECENT_STEPS - 1):
            watch.add(_steps(step, [560] * 8, [180] * 6 + [20, 180]))
        for step in range(first + RECENT_STEPS - 1, first + 2 * RECENT_STEPS - 1):
            watch.add(_steps(step, [400] * 8, [20] * 8))
    assert watch.check() == []


def test_ranks_late_as_often_as_each_other_are_not_flagged() -> None:
    # Two ranks late in turn, each in half the steps: neither stands out.
    watch = EarlyWatch(window_ns=15 * 10**9)
    for step in range(12):
        watch.add(_steps(step, [400] * 8, [20] * 8))
    for step in range(12, 12 + 4 * RECENT_STEPS):
        waits = [180] * 8
        waits[2 if step % 2 else 5] = 20
        watch.add(_steps(step, [560] * 8, waits))
    assert watch.check() == []


def test_ranks_arriving_a_few_at_a_time_give_the_same_flags_in_rings_that_double() -> None:
    """A large job's first window brings its ranks a poll at a time: the rings grow by
    doubling (copying them for each poll's new ranks grew as ranks²), and the columns not
    reported yet are ranks that never reported, so the flags are those of whole steps."""
    spec = ClusterSpec(dp=8, pp=2, tp=2, steps=60, seed=3, window_s=WINDOW_S)
    outputs = list(SimulatedCluster(spec, parse_faults(["slow-gpu:rank=29,factor=2.0,start=25"]))
                   .run())
    whole, sliced = EarlyWatch(int(WINDOW_S * 1e9)), EarlyWatch(int(WINDOW_S * 1e9))
    flags: dict[str, list[Finding]] = {"whole": [], "sliced": []}
    widths = []
    for output in outputs:
        whole.add(output.steps)
        flags["whole"] += whole.check()
        for record in sorted(output.steps, key=lambda r: r.rank):  # one rank per poll
            sliced.add([record])
            widths.append(sliced._jobs[record.job_id].duration_ns.shape[1])
            flags["sliced"] += sliced.check()
    assert flags["whole"] and [f.rank for f in flags["whole"]] == [29]
    assert flags["sliced"] == flags["whole"]
    # 32 ranks one at a time: the rings were copied 6 times (1, 2, 4, 8, 16, 32), not 32.
    assert len(set(widths)) == 6 and max(widths) == 32


def test_the_counts_of_who_reported_each_step_follow_every_arrival() -> None:
    """Which steps are complete is read off counts kept as records come (reading the whole
    ring on every poll cost ranks x 64 per poll): after any mix of arrivals (repeats, old
    steps, steps that reset their ring row, ranks beyond the room so far), they are the
    ring's own counts."""
    rng = np.random.default_rng(7)
    watch = EarlyWatch(window_ns=15 * 10**9)
    for poll in range(400):
        size = int(rng.integers(1, 40))
        step = np.maximum(0, poll // 4 + rng.integers(-70, 3, size))  # some older than the ring
        rank = rng.integers(0, 1 + poll // 8, size)  # the job grows
        watch.add([StepRecord(job_id="j", rank=int(r), step=int(s), start_ns=int(s) * 10**9,
                              duration_ns=400_000_000, collective_ns=20_000_000)
                   for r, s in zip(rank, step, strict=True)])
        watch.check()
        job = watch._jobs["j"]
        assert job.row_seen.tolist() == job.seen.sum(axis=1).tolist(), poll
        assert job.rank_rows.tolist() == job.seen.sum(axis=0).tolist(), poll
        assert job.active_ranks == int(job.seen.any(axis=0).sum()), poll
