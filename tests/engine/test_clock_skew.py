"""One rank's clock off its peers' (NTP drift, a host set wrong) must not decide the job's windows:
the engine estimates each rank's offset from the step records, corrects the rank's times before
windowing, holds its records while the estimate forms, names it in a ``clock-skew`` finding, and
no healthy rank's data is dropped as late, and no rank is called hung because of it.

The estimator and the hold are shown in process; the whole path over the real broker, with
``trainscope pipeline`` as its own process reading 8 jobs (skews of ±30 s and ±600 s, each with
the job on one partition and spread over several) published by simulated producers whose rank 3
runs on the wrong clock while rank 5 runs on a slow GPU."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, start_publisher

from trainscope.engine.clocks import MIN_STEPS, RankClocks
from trainscope.engine.state import FAR_PAST
from trainscope.engine.windows import WindowEngine
from trainscope.schemas.records import StepBatch, StepRecord

STEP_NS = 400_000_000


def steps_of(rank: int, first: int, count: int, skew_ns: int, rng: np.random.Generator,
             job: str = "j") -> list[StepRecord]:
    """Steps of one rank of a synchronous job: each ends at the same true time on every rank
    (plus a few ms of drain), stamped by the rank's clock ``skew_ns`` ahead."""
    return [
        StepRecord(job_id=job, rank=rank, step=s,
                   start_ns=10**12 + s * STEP_NS + skew_ns,
                   duration_ns=STEP_NS + int(rng.integers(0, 5_000_000)))
        for s in range(first, first + count)
    ]


def test_estimator_takes_the_majority_of_ranks_and_enough_steps() -> None:
    rng = np.random.default_rng(0)
    clocks = RankClocks()
    skew_ns = 30 * 10**9
    # Only 2 of 8 ranks reported these steps: no agreement yet, whatever their clocks.
    clocks.note_steps(StepBatch.from_records(
        steps_of(3, 0, 5, skew_ns, rng) + steps_of(0, 0, 5, 0, rng)))
    assert clocks.estimates(world_size=8) == {}
    for rank in (1, 2, 4, 5, 6, 7):
        clocks.note_steps(StepBatch.from_records(steps_of(rank, 0, MIN_STEPS - 1, 0, rng)))
    assert clocks.estimates(world_size=8) == {}  # a majority, but on too few steps
    for rank in (1, 2, 4, 5, 6, 7):
        clocks.note_steps(StepBatch.from_records(steps_of(rank, MIN_STEPS - 1, 1, 0, rng)))
    estimates = clocks.estimates(world_size=8)
    assert set(estimates) == set(range(8))
    assert abs(estimates[3][0] - skew_ns) < 10_000_000, estimates[3]
    assert all(abs(offset) < 10_000_000 for rank, (offset, _) in estimates.items() if rank != 3)
    assert clocks.calibrate(8, tolerance_ns=2 * 10**9) == list(estimates)
    assert clocks.offsets_ns[3] == estimates[3][0]
    assert all(clocks.offsets_ns[r] == 0 for r in range(8) if r != 3)  # jitter is not corrected
    assert set(clocks.reported()) == {3}
    # Bounded: only the newest step numbers are kept.
    clocks.note_steps(StepBatch.from_records(steps_of(0, 10, 100, 0, rng)))
    assert len(clocks.ends) <= 32


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("spacing", [1, 100_003])  # ranks numbered densely (a table) or not
def test_estimates_are_each_ranks_median_of_its_differences_to_the_agreed_end(
        seed: int, spacing: int) -> None:
    """The estimates, taken for all ranks at once, are those of a median per rank (np.median's,
    even counts included) over the steps a majority reported."""
    rng = np.random.default_rng(seed)
    clocks = RankClocks()
    world = 12
    for rank in range(0, world * spacing, spacing):
        first = int(rng.integers(0, 4))  # ranks that joined late: fewer steps, even counts
        clocks.note_steps(StepBatch.from_records(steps_of(
            rank, first, int(rng.integers(1, 9)), int(rng.integers(-3, 4)) * 10**9, rng)))
    quorum = world // 2 + 1
    differences: dict[int, list[int]] = {}
    for by_rank in clocks.ends.values():
        if len(by_rank) >= quorum:
            agreed = int(np.median(list(by_rank.values())))
            for rank, end in by_rank.items():
                differences.setdefault(rank, []).append(end - agreed)
    expected = {rank: (int(np.median(d)), len(d)) for rank, d in differences.items()
                if len(d) >= MIN_STEPS}
    assert expected  # the case is not empty
    assert clocks.estimates(world_size=world) == expected


def expected_estimates(clocks: RankClocks, world: int) -> dict[int, tuple[int, int]]:
    """Each rank's np.median of its differences to the median end of every step a majority
    reported, from the step ends the estimator keeps."""
    differences: dict[int, list[int]] = {}
    for by_rank in clocks.ends.values():
        if len(by_rank) >= world // 2 + 1:
            agreed = int(np.median(list(by_rank.values())))
            for rank, end in by_rank.items():
                differences.setdefault(rank, []).append(end - agreed)
    return {rank: (int(np.median(d)), len(d)) for rank, d in differences.items()
            if len(d) >= MIN_STEPS}


@pytest.mark.parametrize("seed", range(4))
def test_estimates_taken_after_every_poll_agree_as_steps_gain_ranks_and_re_sends(
        seed: int) -> None:
    """The engine asks after every poll, and a step keeps gaining ranks after its majority
    (each poll brings a slice of a large job's ranks): the estimator grows each step's arrays
    by the new ranks instead of reading the step afresh. Interleaved re-sends (a rank's step
    again, with another end; twice in one batch) must be read afresh. The estimates agree
    with np.median's after every poll."""
    rng = np.random.default_rng(seed)
    clocks = RankClocks()
    world = 40
    skews = {rank: int(rng.integers(-3, 4)) * 10**9 for rank in range(world)}
    polls = 0
    for first in range(0, 12, 3):  # 4 rounds of 3 steps; ranks come in slices of 7
        order = rng.permutation(world).tolist()
        for lo in range(0, world, 7):
            records = [r for rank in order[lo:lo + 7]
                       for r in steps_of(rank, first, 3, skews[rank], rng)]
            if rng.random() < 0.3:  # a re-send of an earlier rank's step, another end
                rank = int(rng.choice(order[:lo + 1]))
                records += steps_of(rank, first, 1, skews[rank], rng)
            if rng.random() < 0.2:  # the same record twice in one batch
                records.append(records[0])
            clocks.note_steps(StepBatch.from_records(records))
            assert clocks.estimates(world_size=world) == expected_estimates(clocks, world)
            polls += 1
        # A poll of nothing but a re-send: the step gains no rank, one end changes.
        rank = int(rng.integers(world))
        clocks.note_steps(StepBatch.from_records(steps_of(rank, first + 1, 1, 10**10, rng)))
        assert clocks.estimates(world_size=world) == expected_estimates(clocks, world)
        polls += 1
    assert polls == 28 and len(expected_estimates(clocks, world)) == world


@pytest.mark.parametrize("skew_s", [600, -600])
def test_first_seconds_a_far_clock_is_held_not_dragging_nor_late(skew_s: int) -> None:
    """Before its offset is known, a rank 600 s ahead does not move the job's watermark and
    one 600 s behind is not dropped as late: its records are held, then corrected."""
    rng = np.random.default_rng(1)
    now = [0.0]
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.5, clock=lambda: now[0],
                          clock_tolerance_s=2.0)
    skew_ns = skew_s * 10**9
    first = [r for rank in range(8)
             for r in steps_of(rank, 0, 1, skew_ns if rank == 3 else 0, rng)]
    engine.add_steps(first[::-1])  # the skewed rank's record comes first
    assert engine.held_records() == 8
    assert engine.watermark_ns("j") == FAR_PAST
    for s in range(1, 20):
        now[0] += 0.1
        engine.add_steps([r for rank in range(8)
                          for r in steps_of(rank, s, 1, skew_ns if rank == 3 else 0, rng)])
        engine.close_ready()
    assert engine.held_records() == 0
    assert engine.stats.late_events == 0
    views = engine.close_all()
    assert views and all(abs(v.clock_offsets[3][0] - skew_ns) < 10_000_000 for v in views)
    # Every step of rank 3 lies with its peers' in the windows of true time.
    by_window = {}
    for view in views:
        for rank, count in view.steps.groupby("rank").size().items():
            by_window.setdefault(view.window_start_ns, {})[rank] = count
    assert all(len(ranks) == 8 for ranks in by_window.values()), by_window


def test_within_a_poll_known_ranks_are_estimated_once_at_its_end_and_new_ranks_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll brings step records through several sources (partitions). A rank whose offset
    is not known yet is estimated with its own source's records (so they need not wait in the
    hold); ranks already known are estimated again once, at the poll's end, where a clock
    that jumped is taken, as it would have been by the source that brought the jump."""
    rng = np.random.default_rng(2)
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.5, clock_tolerance_s=2.0)
    calls: list[int] = []
    calibrate = RankClocks.calibrate

    def counted(self: RankClocks, world_size: int, tolerance_ns: int) -> list[int]:
        calls.append(world_size)
        return calibrate(self, world_size, tolerance_ns)

    monkeypatch.setattr(RankClocks, "calibrate", counted)
    jump_ns = 30 * 10**9

    def poll(step: int, *, jumped: bool = False) -> None:
        with engine.one_poll():
            for source in range(4):  # ranks 2s and 2s+1 on source s
                engine.add_steps([r for rank in (2 * source, 2 * source + 1)
                                  for r in steps_of(rank, step, 1,
                                                    jump_ns if jumped and rank == 3 else 0,
                                                    rng)], source)

    poll(0)
    assert len(calls) == 4  # every rank new: each source's estimated at once
    assert engine.held_records() == 8
    for step in range(1, MIN_STEPS + 2):
        calls.clear()
        poll(step)
    assert len(calls) == 1 and engine.held_records() == 0  # known: once, at the poll's end
    assert engine.offset_ns("j", 3) == 0
    for step in range(MIN_STEPS + 2, 3 * MIN_STEPS + 4):  # rank 3's clock jumps 30 s ahead
        calls.clear()
        poll(step, jumped=True)
        assert len(calls) == 1
    assert abs(engine.offset_ns("j", 3) - jump_ns) < 10_000_000
    calls.clear()
    engine.add_steps(steps_of(0, 200, 1, 0, rng))  # outside a poll: at once, as before
    assert len(calls) == 1


# -- over the real broker -----------------------------------------------------------------

SKEWED, SLOW = 3, 5
STEPS = 40
JOB = ["--dp", "2", "--pp", "2", "--tp", "2", "--steps", str(STEPS), "--window-s", "5",
       "--fault", f"slow-gpu:rank={SLOW},factor=1.5"]
CASES = [(skew_s, keying) for skew_s in (30, -30, 600, -600) for keying in ("one", "several")]

_READ = r"""
import json, sys
from trainscope.detectors.diagnosis import diagnose
from trainscope.schemas.records import Finding
from trainscope.sinks.clickhouse import connect
client = connect(sys.argv[1])
out = {}
for job in sys.argv[2:]:
    steps = client.query("SELECT rank, count() FROM step_records FINAL WHERE job_id = {j:String} "
                         "GROUP BY rank", parameters={"j": job}).result_rows
    result = client.query("SELECT * FROM findings FINAL WHERE job_id = {j:String}",
                          parameters={"j": job})
    findings = [Finding(**dict(zip(result.column_names, row))) for row in result.result_rows]
    out[job] = {
        "steps": {str(rank): count for rank, count in steps},
        "categories": sorted({f.category for f in findings}),
        "skews": [(f.rank, f.evidence["offset_s"]) for f in findings
                  if f.category == "clock-skew"],
        "suspects": [(s.rank, s.category) for s in diagnose(findings)],
    }
print(json.dumps(out))
"""


def read_store(store: Path, jobs: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", _READ, str(store), *jobs],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.kafka
def test_skewed_rank_is_named_corrected_and_never_costs_its_peers_data(
    kafka_broker: TansuBroker, tmp_path: Path
) -> None:
    url = kafka_broker.url
    jobs, publishers = {}, []
    try:
        for skew_s, keying in CASES:
            job = f"skew-{tmp_path.name}-{skew_s}-{keying}"
            # One key for the whole job, or one per rank (spread over the topic's partitions).
            keys = ["--key-by", "job"] if keying == "one" else ["--gpus-per-host", "1"]
            publishers.append(start_publisher(
                url, *JOB, "--job-id", job, "--clock-skew", f"{SKEWED}:{skew_s}", *keys,
                out=tmp_path / f"{job}.out"))
            jobs[job] = skew_s
        for publisher in publishers:
            assert publisher.wait(timeout=120) == 0
    finally:
        for publisher in publishers:
            if publisher.poll() is None:
                publisher.kill()
    pipeline = PipelineProcess(url, tmp_path / "store", f"skew-{tmp_path.name}",
                               "--window-s", "5", "--lateness-s", "1", "--close-idle-s", "3",
                               "--idle-exit-s", "5", "--no-auto-profile",
                               logs=tmp_path / "pipeline")
    try:
        assert pipeline.wait(timeout_s=300) == 0, pipeline.err_text()
    finally:
        if pipeline.process.poll() is None:
            pipeline.kill()
    assert "Traceback" not in pipeline.err_text()
    stats = pipeline.stats()
    assert stats["window"]["dropped"] == 0, stats  # nothing late
    store = read_store(tmp_path / "store", list(jobs))
    for job, skew_s in jobs.items():
        seen = store[job]
        assert seen["steps"] == {str(rank): STEPS for rank in range(8)}, (job, seen["steps"])
        assert "hang" not in seen["categories"], (job, seen)
        assert seen["skews"], (job, seen)
        for rank, offset_s in seen["skews"]:
            assert rank == SKEWED, (job, seen["skews"])
            assert abs(offset_s - skew_s) <= 0.1 * abs(skew_s), (job, offset_s)
        # The real fault of the same job is still found, on the right rank.
        real = [(rank, category) for rank, category in seen["suspects"]
                if category != "clock-skew"]
        assert real and real[0][0] == SLOW, (job, seen["suspects"])


def test_a_job_checkpointed_before_clock_estimates_restores_with_defaults() -> None:
    """Open windows pickled by a version whose job state had no clocks nor per-rank progress
    restore with those fields at their defaults, and windowing goes on."""
    rng = np.random.default_rng(2)
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.5, clock_tolerance_s=2.0)
    engine.add_steps([r for rank in range(4) for r in steps_of(rank, 0, 5, 0, rng)])
    state = engine.snapshot()
    for job in state["jobs"].values():  # as the older version pickled it
        del job.__dict__["clocks"], job.__dict__["rank_progress"]
    restored = WindowEngine(window_s=1.0, allowed_lateness_s=0.5, clock_tolerance_s=2.0)
    assert restored.restore(pickle.loads(pickle.dumps(state))) > 0
    restored.add_steps([r for rank in range(4) for r in steps_of(rank, 5, 5, 0, rng)])
    views = restored.close_all()
    assert sum(len(v.steps) for v in views) == 40
    assert restored.stats.late_events == 0


@pytest.mark.parametrize("ranks", [range(-1, 9), range(0, 10 * 100_003, 100_003)])
def test_offset_lookup_agrees_with_the_offsets_in_force(ranks: range) -> None:
    """The arrays the engine reads per record (dense by rank, or the dict where ranks are too
    sparse for a table) say what ``offsets_ns`` says, also after offsets change."""
    clocks = RankClocks()
    known = list(ranks)[:6]
    clocks.offsets_ns.update({r: (i % 3 - 1) * 10**9 for i, r in enumerate(known)})
    asked = np.array([*ranks, max(ranks) + 7, min(ranks) - 5], dtype=np.int64)

    def expected() -> tuple[list[bool], list[int]]:
        return ([int(r) in clocks.offsets_ns for r in asked],
                [clocks.offsets_ns.get(int(r), 0) for r in asked])

    found, offsets = clocks.lookup(asked)
    assert (found.tolist(), offsets.tolist()) == expected()
    clocks.trust_the_rest([(0, StepBatch.from_records(steps_of(
        list(ranks)[7], 0, 1, 0, np.random.default_rng(0))))])
    found, offsets = clocks.lookup(asked)
    assert (found.tolist(), offsets.tolist()) == expected()
    assert found.sum() == 7


class AskEveryRank(RankClocks):
    """The reference: every rank estimated on every calibrate(), as before estimates were
    taken only for the ranks that reported since."""

    def _estimates_due(self, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self._estimate_arrays(world_size)


@pytest.mark.parametrize("seed", range(4))
def test_calibrating_only_the_ranks_that_reported_applies_the_same_offsets(seed: int) -> None:
    """calibrate() estimates the ranks whose step records came since its last call (and, when
    the majority's steps change, those never estimated): the offsets in force after every poll
    are those of estimating every rank every time, through a late majority, ranks taken as they
    were after the hold (one far behind, reporting only later), and a clock that jumps."""
    rng = np.random.default_rng(seed)
    world = 48
    tolerance_ns = 2 * 10**9
    skews = {rank: int(rng.integers(-1, 2)) * 10**9 for rank in range(world)}
    skews[5], skews[17] = 40 * 10**9, -300 * 10**9
    tested, reference = RankClocks(), AskEveryRank()
    late = {17, 30, 31}  # report nothing until the hold has released them at offset 0
    for clocks in (tested, reference):
        clocks.trust_the_rest([("src", StepBatch.from_records(steps_of(r, 0, 1, 0, rng)))
                               for r in sorted(late)])
    changed_ever: set[int] = set()
    for first in range(0, 18, 3):
        if first == 3:
            skews[23] += 60 * 10**9  # the host's clock is set wrong mid-run
        order = rng.permutation(world).tolist()
        for lo in range(0, world, 5):
            ranks = [r for r in order[lo:lo + 5] if first >= 6 or r not in late]
            if not ranks:
                continue
            batch = StepBatch.from_records(
                [rec for r in ranks for rec in steps_of(r, first, 3, skews[r], rng)])
            for clocks in (tested, reference):
                clocks.note_steps(batch)
            changed = tested.calibrate(world, tolerance_ns)
            assert changed == reference.calibrate(world, tolerance_ns)
            assert tested.offsets_ns == reference.offsets_ns
            changed_ever.update(changed)
    assert {5, 17, 23} <= {r for r, offset in tested.offsets_ns.items() if offset}
    assert all(abs(tested.offsets_ns[r] - skews[r]) < 10**8 for r in (5, 17, 23))
    assert len(tested.offsets_ns) == world and changed_ever >= {5, 17, 23}


def test_a_large_jobs_step_medians_are_taken_again_only_as_its_ranks_grow(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 6,400-rank job's steps come 50 ranks a poll, those that end first first: each step's
    median end is taken again once its ranks grew by a 64th since (taken on every poll, the
    medians cost a 100,000-rank job ~1 ms a poll). Between, the kept median lies within a
    64th of the ranks of the true one, each step's table by rank grows in place to what a
    fresh one would be, and after every poll the same ranks are calibrated and corrected as
    with true medians, by offsets within 0.1 ms of theirs."""
    import trainscope.engine.clocks as clocks_module

    world, tolerance_ns = 6400, 2 * 10**9
    seed = np.random.default_rng(11)
    skews = {rank: 0 for rank in range(world)}
    skews.update({int(r): 30 * 10**9 for r in seed.choice(world, 40, replace=False)})
    rng = np.random.default_rng(12)
    batches = []
    for step in range(12):
        # The ranks whose steps end first report first: a kept median is behind the truth.
        records = sorted((rec for r in range(world) for rec in steps_of(r, step, 1, skews[r], rng)),
                         key=lambda rec: rec.start_ns + rec.duration_ns)
        batches += [StepBatch.from_records(records[lo:lo + 50]) for lo in range(0, world, 50)]

    def run(clocks: RankClocks, check: bool) -> list[tuple[list[int], dict[int, int]]]:
        applied = []
        for batch in batches:
            clocks.note_steps(batch)
            applied.append((clocks.calibrate(world, tolerance_ns), dict(clocks.offsets_ns)))
            if not check:
                continue
            for step, entry in vars(clocks).get("_diffs", {}).items():
                if step not in clocks.ends:
                    continue
                ends = np.fromiter(clocks.ends[step].values(), dtype=np.int64)
                below = int((ends <= entry[4]).sum())
                assert abs(below - len(ends) / 2) <= len(ends) / 64 + 1, (step, below)
                column = clocks._dense_diffs(step)
                ranks, diffs = clocks._step_diffs(step, clocks.ends[step])
                fresh = np.full(len(column), np.iinfo(np.int64).max)
                fresh[ranks] = diffs
                assert np.array_equal(column, fresh), step
        return applied

    with monkeypatch.context() as patched:
        patched.setattr(clocks_module, "MEDIAN_RETAKE_SHARE", 0.0)  # every poll: the truth
        truth = run(RankClocks(), check=False)
    kept = RankClocks()
    for (changed, offsets), (true_changed, true_offsets) in zip(run(kept, check=True), truth,
                                                                strict=True):
        # The same ranks calibrated, and corrected, at the same poll; by offsets within a
        # 50th of the steps' 5 ms of jitter.
        assert changed == true_changed
        assert offsets.keys() == true_offsets.keys()
        assert {r for r, o in offsets.items() if o} == {r for r, o in true_offsets.items() if o}
        assert all(abs(offsets[r] - true_offsets[r]) <= 100_000 for r in offsets)
    assert vars(kept)["_median_takes"] < len(batches)  # kept between polls, not taken each
    assert {r for r, offset in kept.offsets_ns.items() if offset} == {
        r for r, skew in skews.items() if skew}
