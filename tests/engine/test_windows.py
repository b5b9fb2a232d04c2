"""The window engine against a straightforward per-event computation."""

from __future__ import annotations

import numpy as np
import pytest

from trainscope.engine.windows import WindowEngine
from trainscope.schemas import FunctionSummary, MetricSample, SpanBatch, StepRecord, summaries

WINDOW_NS = 10**9


def random_batch(rng: np.random.Generator, n: int, t0_ns: int, span_ns: int) -> SpanBatch:
    return SpanBatch.from_arrays(
        job_id="job",
        layers=["torch_op", "collective", "gc"],
        names=["forward", "all_reduce", "gc.collect"],
        rank=rng.integers(0, 8, n),
        fn=rng.integers(0, 3, n),
        step=np.zeros(n),
        start_ns=t0_ns + rng.integers(0, span_ns, n),
        duration_ns=rng.integers(1_000, 5_000_000, n),
        bytes_moved=rng.integers(0, 100, n),
    )


def test_summaries_match_naive_groupby() -> None:
    rng = np.random.default_rng(7)
    batches = [random_batch(rng, 5_000, i * WINDOW_NS // 2, WINDOW_NS) for i in range(6)]
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=10.0)
    engine.add_spans(batches)
    views = engine.close_all()

    expected: dict[tuple[int, int, str], list[int]] = {}
    moved: dict[tuple[int, int, str], int] = {}
    for batch in batches:
        for e in batch.to_events():
            key = (e.start_ns // WINDOW_NS, e.rank, e.name)
            expected.setdefault(key, []).append(e.duration_ns)
            moved[key] = moved.get(key, 0) + e.bytes_moved
    got = {}
    for view in views:
        for row in view.summaries.itertuples():
            got[(view.window_start_ns // WINDOW_NS, row.rank, row.name)] = row
    assert set(got) == set(expected)
    for key, durations in expected.items():
        row, d = got[key], np.array(durations)
        assert row.count == len(d)
        assert row.total_ns == d.sum()
        assert row.min_ns == d.min() and row.max_ns == d.max()
        assert row.m2_ns2 == pytest.approx(((d - d.mean()) ** 2).sum(), rel=1e-9)
        assert row.bytes_total == moved[key]
        assert sum(row.sketch_counts) == len(d)
    assert engine.stats.spans_received == 30_000
    assert engine.stats.late_events == 0


def test_watermark_closes_windows_and_counts_late_events() -> None:
    rng = np.random.default_rng(1)
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.5)
    engine.add_spans([random_batch(rng, 100, 0, WINDOW_NS // 2)])
    assert engine.close_ready() == []  # watermark has not passed the end of window 0
    engine.add_spans([random_batch(rng, 100, 2 * WINDOW_NS, WINDOW_NS // 2)])
    closed = engine.close_ready()
    assert [v.window_start_ns for v in closed] == [0]
    late = random_batch(rng, 40, 0, WINDOW_NS // 2)
    engine.add_spans([late])
    assert engine.stats.late_events == 40
    engine.add_steps([StepRecord(job_id="job", rank=0, step=1, start_ns=10, duration_ns=5)])
    assert engine.stats.late_events == 41
    assert [v.window_start_ns for v in engine.close_all()] == [2 * WINDOW_NS]


def test_producer_summaries_merge_with_raw_events() -> None:
    durations_a = np.arange(1, 101) * 10_000
    durations_b = np.arange(101, 201) * 10_000
    engine = WindowEngine(window_s=1.0)
    engine.add_spans(
        [
            SpanBatch.from_arrays(
                job_id="job",
                layers=["torch_op"],
                names=["forward"],
                rank=np.full(100, 3),
                fn=np.zeros(100),
                step=np.zeros(100),
                start_ns=np.arange(100) * 1000,
                duration_ns=durations_a,
            )
        ]
    )
    summary: FunctionSummary = summaries.summarize(
        durations_b,
        job_id="job",
        rank=3,
        layer="torch_op",
        name="forward",
        window_start_ns=0,
        window_end_ns=WINDOW_NS,
    )
    engine.add_summaries([summary])
    (view,) = engine.close_all()
    (row,) = view.summaries.itertuples()
    both = np.concatenate([durations_a, durations_b])
    assert row.count == 200
    assert row.total_ns == both.sum()
    assert row.m2_ns2 == pytest.approx(((both - both.mean()) ** 2).sum(), rel=1e-9)
    assert sum(row.sketch_counts) == 200


def test_an_intervals_metrics_meet_its_summaries_in_one_window() -> None:
    # The host agent stamps a window's summaries with its start and its readings with its end.
    engine = WindowEngine(window_s=1.0)
    summary = summaries.summarize(
        np.array([1_000]), job_id="job", rank=0, layer="ebpf", name="read",
        window_start_ns=WINDOW_NS, window_end_ns=2 * WINDOW_NS,
    )
    engine.add_summaries([summary])
    engine.add_metrics([
        MetricSample(job_id="job", rank=0, ts_ns=2 * WINDOW_NS, name="sm_util_pct", value=90.0),
        MetricSample(job_id="job", rank=0, ts_ns=WINDOW_NS + 1, name="power_w", value=300.0),
    ])
    (view,) = engine.close_all()
    assert view.window_start_ns == WINDOW_NS
    assert len(view.summaries) == 1
    assert sorted(view.metrics["name"]) == ["power_w", "sm_util_pct"]


def test_negative_durations_are_rejected_and_counted() -> None:
    engine = WindowEngine(window_s=1.0)
    engine.add_spans(
        [
            SpanBatch.from_arrays(
                job_id="job",
                layers=["torch_op"],
                names=["forward"],
                rank=[0, 0],
                fn=[0, 0],
                step=[0, 0],
                start_ns=[0, 1],
                duration_ns=[5, -1],
            )
        ]
    )
    assert engine.stats.rejected == 1
    (view,) = engine.close_all()
    assert view.summaries["count"].sum() == 1


def test_call_paths_are_summarised_separately() -> None:
    rng = np.random.default_rng(3)
    n = 4_000
    fn = rng.integers(0, 3, n)
    paths = np.array([0, 17, 2**63 + 5, 2**64 - 1], dtype=np.uint64)  # ids use all 64 bits
    callpath = paths[rng.integers(0, 4, n)]
    batch = SpanBatch.from_arrays(
        job_id="job", layers=["torch_op", "cuda_kernel", "python"], names=["mm", "gemm", "f"],
        rank=np.zeros(n), fn=fn, step=np.zeros(n), start_ns=np.arange(n),
        duration_ns=rng.integers(1, 1_000, n), callpath_id=callpath,
    )
    engine = WindowEngine(window_s=1.0)
    engine.add_spans([batch])
    (view,) = engine.close_all()
    got = {(r.name, int(r.callpath_id)): r.count for r in view.summaries.itertuples()}
    expected: dict[tuple[str, int], int] = {}
    for e in batch.to_events():
        key = (e.name, e.callpath_id)
        expected[key] = expected.get(key, 0) + 1
    assert got == expected


def test_topologies_from_each_rank_merge_by_rank() -> None:
    from trainscope.schemas import Topology, WorkerInfo

    def declared_by(rank: int) -> Topology:
        return Topology(job_id="job", dp_size=3, workers=[
            WorkerInfo(rank=r, dp_rank=r, host=f"host{r}" if r == rank else "") for r in range(3)
        ])

    engine = WindowEngine(window_s=1.0)
    for rank in (2, 0, 1):
        engine.add_topology(declared_by(rank))
    engine.add_steps([StepRecord(job_id="job", rank=0, step=0, start_ns=0, duration_ns=5)])
    (view,) = engine.close_all()
    assert [(w.rank, w.host) for w in view.topology.workers] == [
        (0, "host0"), (1, "host1"), (2, "host2")]


def test_events_too_far_from_the_jobs_first_window_are_rejected_not_wrapped() -> None:
    """A span at 0 then a summary in 2026 once overflowed the packed window index."""
    engine = WindowEngine(window_s=1.0)
    t0 = 1_767_225_600 * WINDOW_NS
    engine.add_spans([random_batch(np.random.default_rng(1), 10, 0, WINDOW_NS)])
    engine.add_summaries([FunctionSummary(job_id="job", rank=0, layer="gc", name="gc.collect",
                                          window_start_ns=t0, window_end_ns=t0 + WINDOW_NS,
                                          count=1, total_ns=5, min_ns=5, max_ns=5)])
    engine.add_spans([random_batch(np.random.default_rng(2), 10, t0, WINDOW_NS)])
    assert engine.stats.rejected == 11
    assert {v.window_start_ns for v in engine.close_all()} == {0}


def test_an_evicted_job_has_its_open_windows_closed_and_starts_afresh() -> None:
    engine = WindowEngine(window_s=1.0)
    engine.add_spans([random_batch(np.random.default_rng(1), 50, 0, 3 * WINDOW_NS)])
    views = engine.evict_job("job")
    assert [v.window_start_ns for v in views] == [0, WINDOW_NS, 2 * WINDOW_NS]
    assert sum(int(v.summaries["count"].sum()) for v in views) == 50
    assert engine.open_windows() == 0 and engine.evict_job("job") == []


def _frame(view) -> list[tuple]:
    cols = ["rank", "layer", "name", "callpath_id", "count", "total_ns", "min_ns", "max_ns",
            "bytes_total", "sketch_keys", "sketch_counts"]
    rows = view.summaries[cols].itertuples(index=False)
    return sorted(tuple(tuple(v) if isinstance(v, list) else v for v in r) for r in rows)


def test_summary_batches_merge_like_the_spans_they_summarise() -> None:
    rng = np.random.default_rng(11)
    batches = [random_batch(rng, 3_000, k * WINDOW_NS // 2, WINDOW_NS // 2) for k in range(4)]
    from_spans = WindowEngine(window_s=1.0)
    from_spans.add_spans(batches)
    # What a producer on each rank would send: per rank and window, one summary batch of the
    # spans that started in it, made by the producers' own code.
    sent = []
    for batch in batches:
        rank, fn, start = batch.column("rank"), batch.column("fn"), batch.column("start_ns")
        window = start // WINDOW_NS
        for r, w in sorted(set(zip(rank.tolist(), window.tolist(), strict=True))):
            here = (rank == r) & (window == w)
            keys = [(batch.layers[f], batch.names[f], 0) for f in range(len(batch.layers))]
            durations = {k: batch.column("duration_ns")[here & (fn == f)]
                         for f, k in enumerate(keys)}
            moved = {k: int(batch.column("bytes_moved")[here & (fn == f)].sum())
                     for f, k in enumerate(keys)}
            sent += summaries.summary_batches(
                durations, job_id="job", rank=r, window_start_ns=w * WINDOW_NS,
                window_end_ns=(w + 1) * WINDOW_NS, bytes_total=moved, max_rows=2)
    from_summaries = WindowEngine(window_s=1.0)
    from_summaries.add_summaries(sent)
    expected, got = from_spans.close_all(), from_summaries.close_all()
    assert [v.window_start_ns for v in got] == [v.window_start_ns for v in expected]
    assert len(got) == 2
    for a, b in zip(got, expected, strict=True):
        assert _frame(a) == _frame(b)
        assert np.allclose(np.sort(a.summaries["m2_ns2"]), np.sort(b.summaries["m2_ns2"]))
    assert from_summaries.stats.summaries_received == sum(len(b) for b in sent)


def test_row_summaries_and_batches_take_the_same_path() -> None:
    rows = [
        summaries.summarize([5, 7, 9 + r], job_id="job", rank=r, layer="gc", name="gc.collect",
                            window_start_ns=w * WINDOW_NS, window_end_ns=(w + 1) * WINDOW_NS)
        for r in range(3) for w in range(2)
    ]
    by_rows, by_batches = WindowEngine(window_s=1.0), WindowEngine(window_s=1.0)
    by_rows.add_summaries(rows)
    by_batches.add_summaries(summaries.batches_of(rows))
    for a, b in zip(by_rows.close_all(), by_batches.close_all(), strict=True):
        assert _frame(a) == _frame(b) and len(a.summaries) == 3


def test_late_and_out_of_range_summaries_are_counted_not_merged() -> None:
    def batch(window: int, ranks: list[int]):
        (made,) = summaries.batches_of([
            summaries.summarize([10, 20], job_id="job", rank=r, layer="gc", name="gc",
                                window_start_ns=window * WINDOW_NS,
                                window_end_ns=(window + 1) * WINDOW_NS)
            for r in ranks
        ])
        return made

    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.0)
    engine.add_summaries([batch(5, [0, 1])])
    engine.add_summaries([batch(7, [0, 1])])  # the watermark passes window 5
    assert [v.window_start_ns for v in engine.close_ready()] == [5 * WINDOW_NS]
    engine.add_summaries([batch(5, [0]), batch(7, [2, -1, 2**21])])
    assert engine.stats.late_events == 2  # the two durations of the late row
    assert engine.stats.rejected == 2
    (view,) = engine.close_all()
    assert sorted(view.summaries["rank"]) == [0, 1, 2]


def test_each_row_keeps_its_own_sketch_whatever_order_ranks_arrive_in() -> None:
    def batch(rank: int, scale: int):
        durations = {("torch_op", "mm", 0): np.array([1, 2, 3]) * scale,
                     ("gc", "gc", 0): np.array([7]) * scale}
        return summaries.summary_batches(durations, job_id="job", rank=rank, window_start_ns=0,
                                         window_end_ns=WINDOW_NS)

    engine = WindowEngine(window_s=1.0)
    arrivals = [(5, 10**6), (3, 10**3), (9, 10**5), (0, 10)]  # not in rank order
    for rank, scale in arrivals:
        engine.add_summaries(batch(rank, scale))
    (view,) = engine.close_all()
    expected = {(rank, s.name): (s.sketch_keys, s.sketch_counts)
                for rank, scale in arrivals for b in batch(rank, scale)
                for s in b.to_summaries()}
    got = {(r.rank, r.name): (list(r.sketch_keys), list(r.sketch_counts))
           for r in view.summaries.itertuples()}
    assert got == expected


def test_a_job_whose_records_are_held_for_its_clocks_is_not_idle() -> None:
    """A live job's first records are held while its ranks' clock offsets are estimated. The
    job is not idle meanwhile: idle closing once released them and closed the job's first
    window before the rest of its records came (counted late; a Faust worker lost them)."""
    now_s = [5000.0]  # processing time, far from 0
    engine = WindowEngine(window_s=15.0, clock=lambda: now_s[0], clock_tolerance_s=2.0)
    t0_ns = 1_767_225_600 * 10**9

    def steps(step: int) -> list[StepRecord]:
        return [StepRecord(job_id="job", rank=r, step=step, start_ns=t0_ns + step * 10**9,
                           duration_ns=10**9 - 1000) for r in range(4)]

    engine.add_steps(steps(0))
    assert engine.held_records() == 4  # one step of a majority: offsets not known yet
    now_s[0] += 1.0
    assert engine.close_idle(12.0) == [] and engine.held_records() == 4
    for step in (1, 2, 3):
        now_s[0] += 1.0
        engine.add_steps(steps(step))
        assert engine.close_idle(12.0) == []
    assert engine.held_records() == 0 and engine.open_windows() == 1
    now_s[0] += 12.0  # the job really went quiet
    views = engine.close_idle(12.0)
    assert [len(v.steps) for v in views] == [16]
    assert engine.stats.late_events == 0


def test_a_step_that_outlasts_its_window_is_filed_where_it_ended_not_dropped() -> None:
    """A validation pass inside one step: the step's record comes once the step ends, long
    after the window it started in was written. It is filed in the window it ended in (it
    was dropped as late: the run's longest step missing from the store); a step that ended in
    a closed window came late, and stays late."""
    engine = WindowEngine(window_s=1.0, allowed_lateness_s=0.5)

    def step(rank: int, n: int, start_ns: int, duration_ns: int) -> StepRecord:
        return StepRecord(job_id="job", rank=rank, step=n, start_ns=start_ns,
                          duration_ns=duration_ns)

    engine.add_steps([step(r, 1, 100, 200_000_000) for r in range(2)])
    # The other ranks' steps move the watermark past window 0 and its lateness, and the
    # ranks' own stall reports would do so meanwhile in a live job.
    engine.add_steps([step(r, 2, 2 * WINDOW_NS + 100, 1000) for r in range(2, 6)])
    assert [v.window_start_ns for v in engine.close_ready()] == [0]
    long_ns = 2 * WINDOW_NS + 500_000_000  # from window 0 into window 2, still open
    engine.add_steps([step(r, 2, 300_000_000, long_ns) for r in range(2)])
    engine.add_steps([step(0, 9, 500, 1000)])  # in window 0, ended there: late
    assert engine.stats.late_events == 1
    assert engine.stats.steps_outlasting == 2
    views = {v.window_start_ns: v for v in engine.close_all()}
    filed = views[2 * WINDOW_NS].steps
    outlasting = filed[filed["duration_ns"] == long_ns]
    assert sorted(outlasting["rank"]) == [0, 1]
    assert set(outlasting["start_ns"]) == {300_000_000}  # its own start, kept
