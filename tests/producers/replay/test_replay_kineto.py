"""``trainscope replay kineto`` on profiler traces written by a real 2-rank gloo job."""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from click.testing import CliRunner

from trainscope.producers.replay import cli as replay_cli
from trainscope.producers.replay.kineto import condense, layer_of, load, trace_files
from trainscope.producers.replay.publish import publish_records
from trainscope.schemas.callpath import callpath_id, normalise_name
from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import FunctionSummary, StepRecord, SummaryBatch
from trainscope.streams.bus import EVENTS_TOPIC
from trainscope.streams.memory_bus import MemoryBus

WINDOW_NS = 1_000_000_000


def _profile_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(schedule=schedule, with_stack=True) as prof:
        for _ in range(4):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            prof.step()
    # One plain file and one gzip file, named like torch's tensorboard handler does.
    name = f"worker{rank}.pt.trace.json" + (".gz" if rank == 1 else "")
    prof.export_chrome_trace(str(Path(out_dir) / name))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    from kafka_broker import free_port  # the shared helper that picks a free local port

    out = tmp_path_factory.mktemp("kineto")
    mp.start_processes(_profile_rank, args=(2, free_port(), str(out)), nprocs=2,
                       start_method="spawn")
    return out


def _raw_events(path: Path) -> tuple[int, dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        doc = json.load(handle)
    return doc["distributedInfo"]["rank"], doc


def test_summaries_total_what_the_traces_hold(traces: Path) -> None:
    files = trace_files([traces])
    assert len(files) == 2
    bus = MemoryBus()
    for path in files:
        trace = load(path)
        result = condense(trace, "replayed", WINDOW_NS)
        publish_records(bus, "replayed", [*result.steps, *result.summaries])
    consumer = bus.consumer([EVENTS_TOPIC], "check")
    records = [r for m in consumer.poll(max_records=100_000) for r in decode_batch(m.value)]
    assert not [r for r in records if isinstance(r, FunctionSummary)]  # batches only
    summaries = [s for r in records if isinstance(r, SummaryBatch) for s in r.to_summaries()]
    got: dict[tuple[int, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for s in summaries:
        got[(s.rank, s.layer, s.name)][0] += s.count
        got[(s.rank, s.layer, s.name)][1] += s.total_ns
    # Expected, straight from the JSON: every complete event of a known category, per rank.
    expected: dict[tuple[int, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for path in files:
        rank, doc = _raw_events(path)
        for event in doc["traceEvents"]:
            if event.get("ph") != "X" or event["name"].startswith("ProfilerStep#"):
                continue
            layer = layer_of(event.get("cat", ""), event["name"])
            if layer is None:
                continue
            # Object addresses in names ("... at 0x7f...") are dropped, so ranks compare.
            key = (rank, layer, normalise_name(event["name"]))
            expected[key][0] += 1
            expected[key][1] += round(event["dur"] * 1000)
    assert {k[0] for k in expected} == {0, 1}
    assert dict(got) == dict(expected)
    assert not any(" at 0x" in name for _, _, name in got)
    assert {"python", "torch_op"} <= {k[1] for k in got}
    # Windows are aligned, and every summary sits where its events started.
    assert all(s.window_start_ns % WINDOW_NS == 0 for s in summaries)
    # Three active profiler steps per rank become step records.
    steps = [r for r in records if isinstance(r, StepRecord)]
    assert sorted((r.rank, r.step) for r in steps) == [(r, s) for r in (0, 1) for s in (1, 2, 3)]


def test_call_paths_follow_the_nesting_of_the_trace(traces: Path) -> None:
    trace = load(trace_files([traces])[0])
    result = condense(trace, "replayed", WINDOW_NS)
    rows = [s for batch in result.summaries for s in batch.to_summaries()]
    ids = {s.callpath_id for s in rows}
    linear = [s for s in rows if s.name == "aten::linear"]
    assert linear
    # aten::linear is called from a Python frame: its id is not the root-level one.
    assert all(s.callpath_id != callpath_id(0, "torch_op", "aten::linear") for s in linear)
    assert len(ids) > len({(s.layer, s.name) for s in rows}) / 2


def test_the_command_reads_a_directory_and_publishes(traces: Path, monkeypatch) -> None:
    bus = MemoryBus()
    monkeypatch.setattr(replay_cli, "open_bus", lambda url: bus)
    result = CliRunner().invoke(
        replay_cli.replay, ["kineto", str(traces), "--job", "J", "--bus", "memory"]
    )
    assert result.exit_code == 0, result.output
    assert "rank 0" in result.output and "rank 1" in result.output
    records = [
        r
        for m in bus.consumer([EVENTS_TOPIC], "c").poll(max_records=100_000)
        for r in decode_batch(m.value)
    ]
    ranks = {int(r.column("rank")[0]) if isinstance(r, SummaryBatch) else r.rank
             for r in records}
    assert ranks == {0, 1} and {r.job_id for r in records} == {"J"}
    assert f"published {len(records)} records" in result.output


def test_rank_from_the_file_name_when_the_trace_has_no_distributed_info(tmp_path) -> None:
    doc = {"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0,
                            "dur": 2.5, "pid": 1, "tid": 1}], "baseTimeNanoseconds": 10**18}
    path = tmp_path / "trace_rank7.json"
    path.write_text(json.dumps(doc))
    trace = load(path)
    assert trace.rank == 7
    (batch,) = condense(trace, "j", WINDOW_NS).summaries
    (summary,) = batch.to_summaries()
    assert (summary.count, summary.total_ns, summary.rank) == (1, 2500, 7)
    assert summary.window_start_ns == (10**18 + 1000) // WINDOW_NS * WINDOW_NS


@pytest.mark.parametrize(
    ("content", "name", "expected"),
    [
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', "rank0.json",
         "invalid JSON at line 1 column"),
        (gzip.compress(b'{"traceEvents": []}' * 50)[:40], "rank0.json.gz", "truncated gzip"),
        (b'{"events": []}', "rank0.json", "no 'traceEvents' list"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": "soon", "dur": 1}]}', "rank0.json",
         "traceEvents[0]"),
        (b'{"traceEvents": []}', "trace.json", "cannot tell the rank"),
    ],
)
def test_malformed_files_give_one_clear_line(tmp_path, content, name, expected) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    result = CliRunner().invoke(replay_cli.replay, ["kineto", str(path)])
    assert result.exit_code == 1
    message = result.output.strip()
    assert message.startswith("Error: ") and len(message.splitlines()) == 1, message
    assert str(path) in message and expected in message
