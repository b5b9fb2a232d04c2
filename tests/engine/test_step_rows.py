"""Messages of one step record each are handled as a poll's columns (engine/step_rows.py); the
stream job must do with them exactly what it does message by message."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import trainscope.engine.intake as intake
from trainscope.engine.caps import Caps
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.engine.step_rows import StepRows, one_step
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.codec import encode_stamped
from trainscope.schemas.records import MetricBatch, StepBatch, StepRecord
from trainscope.transport.bus import Message

PARTITIONS = 4
WINDOW_S = 2.0


def bus_messages(seed: int) -> list[Message]:
    """A 16-rank simulated job (rank 3's clock 3 s ahead, rank 5 a slow GPU) as its producers
    publish it: the topology, each rank's steps one message per step, its summaries per window,
    each host's metrics; plus a second job's steps, re-sends at once and windows later, step
    messages that fail validation (a rank beyond the world size, an empty job id) and steps
    far ahead that would open windows over the cap. Partition by rank, offsets in order."""
    rng = np.random.default_rng(seed)
    spec = ClusterSpec(dp=4, pp=2, tp=2, steps=60, seed=seed, window_s=WINDOW_S,
                       forward_ms=6.0, optimizer_ms=5.0, clock_skew_s=((3, 3.0),))
    cluster = SimulatedCluster(spec, parse_faults(["slow-gpu:rank=5,factor=1.5"]))
    payloads: list[tuple[int, bytes]] = [(0, encode_stamped([spec.layout.topology(
        spec.job_id)], 999, 1))]
    seq: dict[int, int] = {}
    later: list[tuple[int, int, bytes]] = []

    def send(rank: int, records: list) -> None:
        seq[rank] = seq.get(rank, 0) + 1
        payload = encode_stamped(records, 1 + rank, seq[rank])
        payloads.append((rank, payload))
        roll = rng.random()
        if roll < 0.08:
            payloads.append((rank, payload))  # re-sent at once
        elif roll < 0.12:
            later.append((len(payloads) + int(rng.integers(200, 900)), rank, payload))

    for output in cluster.run():
        for step in output.steps:
            send(step.rank, [StepBatch.from_records([step])])
            roll = rng.random()
            if roll < 0.02:
                send(step.rank, [StepBatch.from_records([StepRecord(
                    job_id=step.job_id, rank=40 + step.rank, step=step.step,
                    start_ns=step.start_ns, duration_ns=step.duration_ns)])])
            elif roll < 0.03:
                send(step.rank, [StepBatch.from_records([StepRecord(
                    job_id="", rank=step.rank, step=step.step, start_ns=step.start_ns,
                    duration_ns=step.duration_ns)])])
            elif roll < 0.04:
                send(step.rank, [StepBatch.from_records([StepRecord(
                    job_id=step.job_id, rank=step.rank, step=step.step + 10_000,
                    start_ns=step.start_ns + int((2 + rng.integers(0, 6)) * WINDOW_S * 1e9),
                    duration_ns=step.duration_ns)])])
            if step.rank < 2:
                send(100 + step.rank, [StepBatch.from_records([StepRecord(
                    job_id="other", rank=step.rank, step=step.step, start_ns=step.start_ns,
                    duration_ns=step.duration_ns)])])
        for summary in output.summaries:
            send(int(summary.column("rank")[0]), [summary])
        by_host: dict[str, list] = {}
        for sample in output.metrics:
            by_host.setdefault(sample.host, []).append(sample)
        for samples in by_host.values():
            send(200 + samples[0].rank, [MetricBatch.from_records(samples)])
        while later and later[0][0] <= len(payloads):
            _, rank, payload = later.pop(0)
            payloads.append((rank, payload))
            later.sort()
    offsets = [0] * PARTITIONS
    messages = []
    for rank, payload in payloads:
        partition = rank % PARTITIONS
        messages.append(Message("events", partition, offsets[partition], None, payload))
        offsets[partition] += 1
    return messages


def run(messages: list[Message], seed: int, sizes: list[int] | None = None
        ) -> dict[str, object]:
    """Everything the stream job did with ``messages``, polled in random sizes (or in
    ``sizes``, then the rest)."""
    windows: list[tuple] = []
    early: list[tuple] = []
    dead: list[tuple[int, int, str]] = []

    class Job(EmbeddedStreamJob):
        def dead_letter(self, message: Message, error: str) -> None:
            dead.append((message.partition, message.offset, error))

    def frame(df: pd.DataFrame) -> list[str]:  # rows in any order (sketches are arrays)
        return sorted(json.dumps(row, sort_keys=True, default=lambda v: getattr(
            v, "tolist", lambda: str(v))()) for row in df.to_dict("records"))

    job = Job(window_s=WINDOW_S, lateness_s=1.0, caps=Caps(open_windows=4),
              on_window=lambda v, f: windows.append(
                  (v.job_id, v.window_start_ns, frame(v.summaries), frame(v.steps),
                   frame(v.metrics), dict(v.clock_offsets),
                   sorted((x.detector, x.rank, x.category) for x in f))),
              on_early=lambda v, f: early.append(
                  sorted((v.job_id, x.detector, x.rank, x.category) for x in f)))
    rng = np.random.default_rng(seed)
    positions, stamps = [], []
    at = 0
    while at < len(messages):
        size = sizes.pop(0) if sizes else int(rng.integers(1, 90))
        job.process_messages(messages[at:at + size])
        at += size
        positions.append(job.offsets.positions(job.engine.closed_before))
        stamps.append(len(job.seen))
    job.finish()
    return {"windows": windows, "early": early, "dead": dead, "positions": positions,
            "stamps": stamps, "stats": job.stats().as_dict()}


@pytest.mark.parametrize("seed", [1, 2])
def test_one_step_messages_as_columns_do_what_the_general_path_does(
        seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = bus_messages(seed)
    lane = run(messages, seed)
    monkeypatch.setattr(intake, "one_step", lambda records: None)  # every message one by one
    general = run(messages, seed)
    for key in ("stats", "dead", "positions", "stamps", "windows", "early"):
        assert lane[key] == general[key], key
    # The workload holds what the columns must get right, not only clean steps.
    stats = general["stats"]
    assert isinstance(stats, dict)
    assert stats["duplicate_batches"] > 50 and stats["window"]["dropped"] > 0
    assert stats["capped_messages"] > 0 and stats["clock_corrections"] >= 1
    assert sum("rank" in e for _, _, e in general["dead"]) > 5  # type: ignore[union-attr]
    assert sum("job_id" in e for _, _, e in general["dead"]) > 2  # type: ignore[union-attr]
    assert {w[0] for w in general["windows"]} == {"sim-job", "other"}  # type: ignore[union-attr]


def test_a_poll_whose_columns_cannot_be_built_is_taken_one_by_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the columns should never raise on decoded batches; if it does, the stream
    job logs it and takes those messages the general way, losing nothing."""
    messages = bus_messages(3)[:1500]
    expected = run(messages, 3)

    def broken(self: StepRows, engine: object) -> None:
        raise RuntimeError("broken columns")

    monkeypatch.setattr(StepRows, "seal", broken)
    assert run(messages, 3) == expected


def test_only_messages_of_exactly_one_step_record_take_the_columns() -> None:
    one = StepBatch.from_records([StepRecord(job_id="j", rank=0, step=1, start_ns=1,
                                             duration_ns=1)])
    two = StepBatch.from_records([StepRecord(job_id="j", rank=0, step=i, start_ns=i,
                                             duration_ns=1) for i in (1, 2)])
    assert one_step([one]) is one
    assert one_step([two]) is None and one_step([one, one]) is None and one_step([]) is None
    assert one_step([StepRecord(job_id="j", rank=0, step=1, start_ns=1, duration_ns=1)]) is None


def test_batches_under_one_stamp_keep_the_first_whichever_way_they_are_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One-step messages into open windows are admitted apart from the poll's order; a stamp
    that another message of the poll also carries (a producer that reused one, or two that
    drew the same id) must still keep the first batch under it, so that a later re-send of
    that batch is dropped, not windowed twice."""
    start = 1_700_000_000 * 10**9

    def step(rank: int, number: int, extra_ns: int = 0) -> StepBatch:
        return StepBatch.from_records([StepRecord(
            job_id="j", rank=rank, step=number, start_ns=start + number * 10**9 + extra_ns,
            duration_ns=900_000_000)])

    opening = [encode_stamped([step(r, n)], 1 + r, n) for n in range(6) for r in range(4)]
    # Into window 2 (steps 4 and 5), open since the first poll.
    two_steps = encode_stamped([StepBatch.concat([step(0, 4, 1), step(0, 5, 1)])], 77, 1)
    one_step_under_77 = encode_stamped([step(1, 5, 2)], 77, 1)
    first_under_88 = encode_stamped([step(2, 5, 3)], 88, 1)
    colliding = [two_steps, one_step_under_77, first_under_88,
                 encode_stamped([step(2, 5, 4)], 88, 1), first_under_88]
    later = [two_steps, one_step_under_77]  # re-sent a poll later
    closing = [encode_stamped([step(r, n)], 1 + r, n) for n in range(6, 12) for r in range(4)]
    payloads = opening + colliding + later + closing
    messages = [Message("events", 0, i, None, p) for i, p in enumerate(payloads)]
    sizes = [len(opening), len(colliding), len(later)]
    lane = run(messages, 7, list(sizes))
    monkeypatch.setattr(intake, "one_step", lambda records: None)
    general = run(messages, 7, list(sizes))
    assert lane == general
    stats = general["stats"]
    # The re-sends of two_steps and of the first batch under (88, 1); one_step_under_77 is
    # windowed both times (its stamp holds two_steps' digest).
    assert isinstance(stats, dict) and stats["duplicate_batches"] == 2
