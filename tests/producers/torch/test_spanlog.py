"""A phase log's pairs reach the recorder's windows as they would one span at a time."""

from __future__ import annotations

import random

from trainscope.producers.torch.spanlog import PhaseLog
from trainscope.schemas.recorder import WindowRecorder

WINDOW_NS = 1_000


def windows(recorder: WindowRecorder) -> dict[int, list[int]]:
    return {start: functions[("torch_op", "forward", 0)].durations_ns
            for start, functions in recorder.take_all()}


def drained_and_added(pairs: list[tuple[int, int]]) -> tuple[dict, dict, int]:
    """The same pairs drained from a log, and added span by span (the reference)."""
    drained, added = WindowRecorder(WINDOW_NS, 0), WindowRecorder(WINDOW_NS, 0)
    for recorder in (drained, added):
        for step_start in range(0, 5_000, 130):  # steps straddle window boundaries
            recorder.step_started(step_start)
    log = PhaseLog("torch_op", "forward")
    for start, duration in pairs:
        log.values.extend((start, duration))
        added.add("torch_op", "forward", start, duration)
    moved = log.drain_into(drained)
    assert drained.recorded == added.recorded == len(pairs)
    return windows(drained), windows(added), moved


def test_a_chunk_over_several_windows_is_filed_as_span_by_span() -> None:
    rng = random.Random(0)
    pairs = sorted((rng.randrange(0, 4_900), rng.randrange(-5, 200)) for _ in range(500))
    drained, added, moved = drained_and_added(pairs)
    assert moved == 500 and len(drained) >= 4  # the chunk spans several windows
    assert drained == added


def test_a_chunk_whose_clock_stepped_back_is_filed_as_span_by_span() -> None:
    pairs = [(2_500, 10), (3_400, 20), (1_200, 30), (1_300, 40), (4_100, 50)]
    drained, added, _ = drained_and_added(pairs)
    assert drained == added and len(drained) == 4


def test_a_chunk_in_one_window_is_one_run() -> None:
    drained, added, _ = drained_and_added([(1_320, 5), (1_400, 7), (1_900, 9)])
    assert drained == added == {1_000: [5, 7, 9]}


class AppendedWhileMeasured(list):
    """A log's values to which the training thread appends one value (a pair's first half)
    every time the sender thread reads their length."""

    def __len__(self) -> int:
        size = super().__len__()
        self.append(7)
        return size


def test_a_take_racing_an_append_takes_whole_pairs_only() -> None:
    log = PhaseLog("torch_op", "forward")
    log.values = AppendedWhileMeasured([1, 10, 2, 20, 3, 30, 4, 40, 5, 50])
    chunk = log.take()
    assert chunk == [1, 10, 2, 20, 3, 30, 4, 40, 5, 50]
    assert list.__len__(log.values) % 2 == 1  # the half pair waits for its other half
