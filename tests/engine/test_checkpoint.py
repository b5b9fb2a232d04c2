"""Checkpoints of open windows: a pipeline that stops anywhere — killed after a commit, killed
between storing a checkpoint and committing it, or stopped on purpose — and restarts from its
checkpoint writes the same windows and findings as one that never stopped, re-reading only what
came after its last commit. In process, on the in-memory bus, with the real chDB store."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from trainscope.cli.demo_job import publish_step
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.engine.bus_job import BusStreamJob
from trainscope.engine.checkpoint import Checkpoint, decode, encode
from trainscope.engine.windows import WindowEngine
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.window import WindowView
from trainscope.sinks.clickhouse import ClickHouseSink
from trainscope.transport.bus import BusError
from trainscope.transport.memory import MemoryBus

WINDOW_S = 5.0


def published_job() -> tuple[MemoryBus, int]:
    bus = MemoryBus()
    cluster = SimulatedCluster(
        ClusterSpec(dp=4, pp=2, tp=1, steps=60, seed=11, window_s=WINDOW_S),
        parse_faults(["slow-gpu:rank=5,factor=1.5"]),
    )
    messages = sum(publish_step(bus, cluster, out, out.step == 0) for out in cluster.run())
    return bus, messages


class Windows:
    """Each written window's content (summaries, steps, metrics) and findings, by window."""

    def __init__(self) -> None:
        self.content: dict[tuple[str, int], str] = {}
        self.findings: dict[tuple[str, int], list[tuple]] = {}
        self.rewritten = 0

    def __call__(self, view: WindowView, findings: list) -> None:
        key = (view.job_id, view.window_start_ns)
        digest = hashlib.sha256()
        for frame in (view.summaries, view.steps, view.metrics):
            digest.update(frame.to_csv(index=False).encode())
        found = sorted((f.detector, f.rank, f.category, f.function, round(f.score, 9))
                       for f in findings)
        if key in self.content:  # closed after the last checkpoint, before the crash
            self.rewritten += 1
            assert self.content[key] == digest.hexdigest(), f"window {key} changed on rewrite"
            assert self.findings[key] == found, f"findings of {key} changed on rewrite"
        self.content[key] = digest.hexdigest()
        self.findings[key] = found


def pipeline(bus: MemoryBus, group: str, windows: Windows, sink: object = None) -> BusStreamJob:
    return BusStreamJob(bus, group=group, sink=sink, window_s=WINDOW_S, lateness_s=1.0,
                    detectors=[PeerDiffDetector(), StepTimeDetector()], on_window=windows,
                    commit_interval_s=3600.0, job_idle_s=None)


def drain(p: BusStreamJob) -> None:
    while p.poll_once(timeout_s=0.0):
        pass
    assert p.finish(drain=True)


def reference(bus: MemoryBus) -> Windows:
    windows = Windows()
    drain(pipeline(bus, "reference", windows))
    return windows


class RefusingCommits:
    """The consumer of a pipeline whose commits the bus refuses (its crash comes next)."""

    def __init__(self, consumer: object) -> None:
        self._consumer = consumer

    def __getattr__(self, name: str) -> object:
        return getattr(self._consumer, name)

    def commit(self, *args: object, **kwargs: object) -> None:
        raise BusError("commit refused (test)")


@pytest.mark.parametrize("crash", ["after-commit", "before-commit"])
def test_restart_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path: Path, crash: str
                                                               ) -> None:
    bus, total = published_job()
    expected = reference(bus)
    sink = ClickHouseSink.open(tmp_path / "store")
    try:
        windows = Windows()
        first = pipeline(bus, "crashing", windows, sink)
        first.poll_once(timeout_s=0.0, max_records=total // 3)
        assert first.commit()
        committed = first.messages
        first.poll_once(timeout_s=0.0, max_records=total // 4)
        if crash == "before-commit":
            first.consumer = RefusingCommits(first.consumer)
        assert first.commit() == (crash == "after-commit")
        assert first.engine.open_windows() > 0
        checkpointed = first.messages
        # SIGKILL: the first pipeline is dropped here, without finish().

        second = pipeline(bus, "crashing", windows, sink)
        drain(second)
        stats = second.stats()
        if crash == "after-commit":
            assert second.messages == total - checkpointed  # nothing re-read
            assert stats.checkpoint_skipped == 0
        else:  # the bus resumes at the commit before: what the checkpoint holds is skipped
            assert second.messages == total - committed
            assert stats.checkpoint_skipped == checkpointed - committed > 0
        assert stats.replayed_events == 0 and stats.window.dropped == 0
    finally:
        sink.close()
    assert windows.content == expected.content
    assert windows.findings == expected.findings
    assert any(f for f in expected.findings.values())  # the slow GPU was found


def test_stop_without_drain_leaves_open_windows_to_the_next_run(tmp_path: Path) -> None:
    bus, total = published_job()
    expected = reference(bus)
    sink = ClickHouseSink.open(tmp_path / "store")
    try:
        windows = Windows()
        first = pipeline(bus, "stopping", windows, sink)
        first.poll_once(timeout_s=0.0, max_records=total // 2)
        open_windows = first.engine.open_windows()
        assert open_windows > 0
        assert first.finish(drain=False)
        assert first.engine.open_windows() == open_windows  # not closed early
        second = pipeline(bus, "stopping", windows, sink)
        drain(second)
        assert second.messages == total - first.messages
    finally:
        sink.close()
    assert windows.rewritten == 0
    assert windows.content == expected.content
    assert windows.findings == expected.findings


def test_a_checkpoint_over_the_size_limit_falls_back_to_re_reading(tmp_path: Path) -> None:
    """Without room for the open windows, positions stop at the oldest open window's first
    message, and the restart rebuilds those windows from the bus."""
    bus, total = published_job()
    expected = reference(bus)
    sink = ClickHouseSink.open(tmp_path / "store")
    try:
        windows = Windows()
        first = pipeline(bus, "small", windows, sink)
        first.max_open_bytes = 1
        first.poll_once(timeout_s=0.0, max_records=total // 2)
        assert first.commit()
        second = pipeline(bus, "small", windows, sink)
        drain(second)
        assert second.messages > total - first.messages  # the open windows were re-read
    finally:
        sink.close()
    assert windows.content == expected.content
    assert windows.findings == expected.findings


def test_a_checkpoint_of_other_window_length_is_refused_with_the_reason() -> None:
    engine = WindowEngine(window_s=15.0)
    blob = encode(Checkpoint(engine=engine.snapshot()))
    with pytest.raises(ValueError, match="restart with the same --window-s"):
        WindowEngine(window_s=5.0).restore(decode(blob).engine or {})


def test_an_unreadable_checkpoint_says_so() -> None:
    with pytest.raises(ValueError, match="unreadable checkpoint"):
        decode(b"\x00garbage")


def test_a_checkpoint_of_the_streams_layout_restores_its_open_windows() -> None:
    """A job upgraded from 0.1.0 (``trainscope.streams``) reads its last checkpoint: its open
    windows close with the rows they held, and the stamps seen and positions are kept
    (tests/data/checkpoint-0.1.0/make.py wrote it with that version)."""
    import json

    from trainscope.detectors.registry import DetectorRunner

    data = Path(__file__).parents[1] / "data" / "checkpoint-0.1.0"
    checkpoint = decode((data / "checkpoint.bin").read_bytes())
    assert isinstance(checkpoint, Checkpoint)
    assert isinstance(checkpoint.runner, DetectorRunner)
    assert checkpoint.positions == {("trainscope.events", 0): 123}
    assert checkpoint.engine is not None
    engine = WindowEngine(window_s=15.0)
    assert engine.restore(checkpoint.engine) == 3
    # Its stamps did not say which windows their batches fed: they wait for the windows open
    # at the restart to close.
    seen = checkpoint.seen
    assert seen is not None and not seen.resent(7, 1, 12345)
    newest_open = {job: max(w) for job, w in checkpoint.engine["windows"].items() if w}
    seen.file_unfiled(newest_open)
    assert seen.resent(7, 1, 12345)
    closed_after = {job: index + 2 for job, index in newest_open.items()}
    seen.forget_closed(lambda job: closed_after[job] - 1)
    assert seen.resent(7, 1, 12345)
    seen.forget_closed(closed_after.__getitem__)
    assert not seen.resent(7, 1, 12345)
    closed = [
        {"window_start_ns": v.window_start_ns, "summaries": len(v.summaries),
         "total_ns": int(v.summaries["total_ns"].sum()), "steps": len(v.steps),
         "metrics": len(v.metrics),
         "ranks": sorted(int(r) for r in v.summaries["rank"].unique())}
        for v in engine.close_all()
    ]
    assert closed == json.loads((data / "expected.json").read_text())


def test_a_checkpoint_naming_an_unknown_old_class_is_refused_with_its_name() -> None:
    import zlib

    # A pickle of one class reference (opcode GLOBAL), to a module that no longer exists.
    blob = zlib.compress(b"ctrainscope.streams.gone\nStranger\n.")
    with pytest.raises(ValueError, match=r"trainscope\.streams\.gone\.Stranger"):
        decode(blob)
