"""The loop's own logic: requests on the bus, trees matched to their request, the diff stored;
and the stream job's handling of profile trees (assembled from parts, stored in call_paths)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from trainscope.engine.core import ProfileParts
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.loop.autoprofile import AutoProfiler
from trainscope.loop.policy import ProfilePolicy
from trainscope.schemas.callpath import callpath_id
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import ControlMessage, Finding, FindingCallPath, ProfileCallPaths
from trainscope.schemas.window import WindowView
from trainscope.transport.bus import CONTROL_TOPIC
from trainscope.transport.memory import MemoryBus

T0 = 1_767_225_600 * 10**9
MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _view() -> WindowView:
    from trainscope.schemas.records import Topology, WorkerInfo

    return WindowView(job_id="j", window_start_ns=T0, window_end_ns=T0 + 10**9,
                      topology=Topology(job_id="j", dp_size=3,
                                        workers=[WorkerInfo(rank=r, dp_rank=r) for r in range(3)]))


def _finding(rank: int = 1) -> Finding:
    return Finding(job_id="j", window_start_ns=T0, window_end_ns=T0 + 10**9, detector="peer-diff",
                   rank=rank, category="gpu-compute", function="forward", score=0.9,
                   victims=[0, 2], message="m")


def tree(rank: int, request_id: str, paths: dict[tuple[str, ...], int], steps: int = 4,
         per_part: int = 1000) -> list[ProfileCallPaths]:
    """A profile tree from {path of names: total ns}; every node a python frame but the
    ``block`` annotation and the ``gloo:`` collectives."""
    rows: dict[int, tuple[int, str, str, int]] = {}
    for path, total in paths.items():
        parent = 0
        for depth, name in enumerate(path):
            layer = ("user_annotation" if name == "block"
                     else "collective" if name.startswith("gloo:") else "python")
            cp = callpath_id(parent, layer, name)
            if depth == len(path) - 1:
                rows[cp] = (parent, layer, name, total)
            parent = cp
    ids = sorted(rows)
    chunks = [ids[i:i + per_part] for i in range(0, len(ids), per_part)]
    return [ProfileCallPaths(
        job_id="j", rank=rank, request_id=request_id, started_ns=T0, stopped_ns=T0 + 10**9,
        steps=steps, part=k, parts=len(chunks), callpaths=chunk,
        parents=[rows[c][0] for c in chunk], layers=[rows[c][1] for c in chunk],
        names=[rows[c][2] for c in chunk], counts=[steps] * len(chunk),
        total_ns=[rows[c][3] for c in chunk], self_ns=[0] * len(chunk),
    ) for k, chunk in enumerate(chunks)]


COMMON = {("main",): 100 * MS, ("main", "step"): 100 * MS, ("main", "step", "fwd"): 40 * MS}
EXTRA = {("main",): 180 * MS, ("main", "step"): 180 * MS, ("main", "step", "fwd"): 120 * MS,
         ("main", "step", "fwd", "block"): 80 * MS,
         ("main", "step", "fwd", "block", "sleep"): 79 * MS}


def _loop(bus: MemoryBus, written: list[FindingCallPath], clock: Clock, **kw) -> AutoProfiler:
    return AutoProfiler(bus.publish, written.extend, steps=3,
                        policy=ProfilePolicy(clock=clock), clock=clock, announce=lambda _: None,
                        **kw)


def _requests(bus: MemoryBus) -> list[ControlMessage]:
    """The control messages published, suspect (rank 1) first."""
    messages = bus.consumer([CONTROL_TOPIC], "check").poll(timeout_s=0.1)
    return sorted((r for m in messages for r in decode_batch(m.value)), key=lambda r: -r.rank)


def test_a_finding_asks_two_ranks_and_their_trees_make_its_call_path() -> None:
    bus, written, clock = MemoryBus(), [], Clock()
    loop = _loop(bus, written, clock)
    loop.on_window(_view(), [_finding()])
    asked = _requests(bus)
    assert [(m.rank, m.steps, m.action) for m in asked] == [(1, 3, "profile"), (0, 3, "profile")]
    suspect_id, peer_id = (m.request_id for m in asked)
    loop.on_profile(tree(1, suspect_id, EXTRA))
    assert written == []  # the peer's tree is not here yet
    loop.on_profile(tree(0, peer_id, COMMON))
    (row,) = written
    assert (row.rank, row.peer_rank, row.category, row.detector) == (1, 0, "gpu-compute",
                                                                     "peer-diff")
    # The deepest path that explains the excess, per step (4 steps), and the block's own cost.
    assert row.path == ["main", "step", "fwd", "block", "sleep"]
    assert row.path_layers[3] == "user_annotation"
    assert row.delta_ns == pytest.approx(79 * MS / 4)
    assert row.path_delta_ns[3] == pytest.approx(80 * MS / 4)
    assert row.path_delta_ns[2] == pytest.approx(80 * MS / 4)
    assert "block" in row.message and loop.counts.completed == 1 and loop.pending == 0


def test_a_straggler_slow_now_and_then_is_asked_for_enough_steps_to_catch_it() -> None:
    import dataclasses

    import pandas as pd

    bus, written, clock = MemoryBus(), [], Clock()
    announced: list[str] = []
    loop = _loop(bus, written, clock)
    loop.announce = announced.append
    # Rank 1 stops for a second every 20 steps (its peers with it, in their collectives).
    steps = pd.DataFrame([(r, k, T0, (1000 if k % 20 == 3 else 50) * MS)
                          for r in range(3) for k in range(40)],
                         columns=["rank", "step", "start_ns", "duration_ns"])
    loop.on_window(dataclasses.replace(_view(), steps=steps), [_finding()])
    assert [(m.rank, m.steps) for m in _requests(bus)] == [(1, 40), (0, 40)]
    assert "for 40 profiled steps (its slow steps come now and then)" in announced[0]


def test_profiles_nobody_asked_for_and_overdue_requests() -> None:
    bus, written, clock = MemoryBus(), [], Clock()
    loop = _loop(bus, written, clock, timeout_s=60)
    loop.on_profile(tree(1, "manual", EXTRA))  # e.g. from `trainscope profile`
    assert loop.counts.unexpected == 1
    loop.on_window(_view(), [_finding()])
    suspect_id = _requests(bus)[0].request_id
    loop.on_profile(tree(1, suspect_id, EXTRA))
    clock.now_s = 61
    loop.on_window(_view(), [])
    assert loop.counts.expired == 1 and loop.pending == 0 and written == []


def test_a_bus_or_store_that_fails_never_raises_into_the_stream_job() -> None:
    clock = Clock()

    def refuse(*_: object) -> None:
        raise RuntimeError("broker down")

    loop = AutoProfiler(refuse, refuse, policy=ProfilePolicy(clock=clock), clock=clock,
                        announce=lambda _: None)
    loop.on_window(_view(), [_finding()])
    assert loop.counts.publish_errors == 1 and loop.pending == 0
    bus = MemoryBus()
    loop = AutoProfiler(bus.publish, refuse, policy=ProfilePolicy(clock=clock), clock=clock,
                        announce=lambda _: None)
    loop.on_window(_view(), [_finding()])
    ids = [m.request_id for m in _requests(bus)]
    loop.on_profile(tree(1, ids[0], EXTRA))
    loop.on_profile(tree(0, ids[1], COMMON))
    assert loop.counts.write_errors == 1 and loop.results[0].path[-1] == "sleep"
    # Nor does a policy that raises.
    broken = ProfilePolicy(clock=clock)
    broken.decide = refuse  # type: ignore[method-assign]
    AutoProfiler(bus.publish, refuse, policy=broken).on_window(_view(), [_finding()])


def test_equal_trees_give_a_row_without_a_path() -> None:
    bus, written, clock = MemoryBus(), [], Clock()
    loop = _loop(bus, written, clock)
    loop.on_window(_view(), [_finding()])
    ids = [m.request_id for m in _requests(bus)]
    loop.on_profile(tree(1, ids[0], COMMON))
    loop.on_profile(tree(0, ids[1], COMMON))
    (row,) = written
    assert row.path == [] and row.delta_ns == 0 and "no call path" in row.message


def test_a_profile_that_caught_the_suspect_waiting_does_not_name_its_wait_as_the_cause(
) -> None:
    """Over its profiled steps the suspect waited for its peer in the all-reduce longer
    than it spent over it anywhere (a slow loader worker kept up while the profile slowed
    both ranks): its longer backward is where it waited, not why its peers wait on it."""
    bus, written, clock = MemoryBus(), [], Clock()
    loop = _loop(bus, written, clock)
    loop.on_window(_view(), [_finding()])
    ids = [m.request_id for m in _requests(bus)]
    waited = {**COMMON, ("main", "step", "backward"): 30 * MS, ("gloo:all_reduce",): 60 * MS}
    loop.on_profile(tree(1, ids[0], {**waited, ("main",): 130 * MS, ("main", "step"): 130 * MS,
                                     ("main", "step", "backward"): 58 * MS,
                                     ("gloo:all_reduce",): 120 * MS}))
    loop.on_profile(tree(0, ids[1], waited))
    (row,) = written
    assert row.path == [] and row.delta_ns == 0, row
    assert "did not catch it holding rank 0" in row.message, row.message
    assert "+15.000 ms/step longer in collectives" in row.message, row.message
    assert "+7.000 ms/step under backward" in row.message, row.message
    # It is asked for once more, longer; a second miss is stored and not asked again.
    again = [m for m in _requests(bus) if m.request_id not in ids]
    assert [(m.rank, m.steps) for m in again] == [(1, 20), (0, 20)], again
    assert loop.counts.retried == 1
    loop.on_profile(tree(1, again[0].request_id, EXTRA))
    loop.on_profile(tree(0, again[1].request_id, COMMON))
    assert written[1].path[-1] == "sleep" and loop.pending == 0, written
    # A slow link's suspect is slow in its collectives: that is its fault, not a wait.
    bus, written = MemoryBus(), []
    loop = _loop(bus, written, Clock())
    loop.on_window(_view(), [msgspec.structs.replace(_finding(), category="network")])
    ids = [m.request_id for m in _requests(bus)]
    loop.on_profile(tree(1, ids[0], {**waited, ("main",): 130 * MS, ("main", "step"): 130 * MS,
                                     ("main", "step", "backward"): 58 * MS,
                                     ("gloo:all_reduce",): 120 * MS}))
    loop.on_profile(tree(0, ids[1], waited))
    assert written[0].path[-1] == "backward", written


def test_the_parts_of_a_session_are_handed_over_once_whole() -> None:
    parts = tree(1, "r", EXTRA, per_part=2)
    assert len(parts) == 3
    seen: list[list[ProfileCallPaths]] = []
    pipeline = EmbeddedStreamJob([], on_profile=seen.append)
    pipeline.process_records(parts[:2])
    assert seen == []
    pipeline.process_records(parts[2:])
    assert seen == [parts] and pipeline.stats().profile_parts == 3
    # Sessions left unfinished are bounded.
    open_parts = ProfileParts(max_open=2)
    for i in range(4):
        assert open_parts.add(tree(1, f"r{i}", EXTRA, per_part=2)[0]) is None
    assert open_parts.dropped == 2


_STORE = r"""
import json, sys
from trainscope.sinks.clickhouse import ClickHouseSink
from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.schemas.codec import decode_batch
sink = ClickHouseSink.open(sys.argv[1])
parts = decode_batch(bytes.fromhex(sys.argv[2]))
EmbeddedStreamJob([], sink=sink).process_records(parts)
rows = sink.client.query("SELECT rank, window_start_ns, name, layer, path, depth, total_ns, "
                         "steps FROM call_paths ORDER BY depth").result_rows
print(json.dumps(rows))
"""


def test_a_profile_tree_is_stored_in_call_paths(tmp_path) -> None:
    from trainscope.schemas.codec import encode_batch

    parts = tree(1, "r", EXTRA, per_part=2)
    done = subprocess.run([sys.executable, "-c", _STORE, str(tmp_path / "store"),
                           encode_batch(parts).hex()],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == len(EXTRA)
    deepest = rows[-1]
    # Each row spells its whole path out, across the parts it was sent in.
    assert deepest[:5] == [1, T0, "sleep", "python", ["main", "step", "fwd", "block", "sleep"]]
    assert deepest[5:] == [4, 79 * MS, 4]
