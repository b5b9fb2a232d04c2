"""The --timeline file: Chrome Trace Event Format, real and ideal run, one thread per stream."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest

from trainscope.schemas.optrace import load_trace, read_meta
from trainscope.whatif.analysis import analyse
from trainscope.whatif.generate import JobSpec
from trainscope.whatif.layout import build_layout
from trainscope.whatif.timeline import STREAMS, write_timeline

DATA = Path(__file__).resolve().parent.parent / "data" / "stragglers-ST"
REQUIRED = {"X": {"name", "ph", "pid", "tid", "ts", "dur"}, "M": {"name", "ph", "pid", "args"}}


def real_layout():
    meta = read_meta(DATA / "meta-ST.yaml")
    return build_layout(load_trace(DATA / "trace-ST.parquet", meta), meta)


def generated_layout(layout_of):
    return layout_of(JobSpec(dp_size=2, pp_size=3, steps=[2, 3, 7], seed=41, noise=0.05))


@pytest.fixture(params=["real", "generated"])
def timeline(request, layout_of, tmp_path):
    layout = real_layout() if request.param == "real" else generated_layout(layout_of)
    path = write_timeline(layout, analyse(layout), tmp_path / "tl")
    return layout, json.loads(path.read_text())


def test_events_have_the_required_fields(timeline):
    _, trace = timeline
    events = trace["traceEvents"]
    assert events
    for e in events:
        assert REQUIRED[e["ph"]] <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            assert isinstance(e["pid"], int) and isinstance(e["tid"], int)


def test_every_worker_has_a_real_and_an_ideal_process_with_named_streams(timeline):
    layout, trace = timeline
    events = trace["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    expected = {
        f"stage {s} · dp {d} · {run}"
        for s in range(layout.meta.pp_size)
        for d in range(layout.meta.dp_size)
        for run in ("real", "ideal")
    }
    assert set(process.values()) == expected
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert set(threads.values()) == set(STREAMS)
    # Every slice sits on a named thread of a named process.
    for e in events:
        if e["ph"] == "X":
            assert (e["pid"], e["tid"]) in threads
    # Real and ideal of one worker are neighbours.
    for pid, name in process.items():
        if name.endswith("real"):
            assert process[pid + 1] == name.replace("real", "ideal")


def test_all_steps_and_all_ops_are_shown(timeline):
    layout, trace = timeline
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    per_run = len(layout.step_ids) * layout.nodes * layout.meta.dp_size
    assert len(slices) == 2 * per_run
    assert {e["args"]["step"] for e in slices} == set(layout.step_ids.tolist())


def test_no_two_slices_on_one_thread_overlap(timeline):
    _, trace = timeline
    by_thread = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start + 1e-6
