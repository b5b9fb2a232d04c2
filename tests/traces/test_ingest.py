"""Whole-trace ingestion: every event class, to the nanosecond, with every event counted.

The traces come from real torch.profiler runs in this session (a 2-rank gloo DDP job written by
torch's ``tensorboard_trace_handler``, one plain ``export_chrome_trace()``), from a real H100
(``tests/data/kineto-cuda-h100``) and, for the older category spellings, from hand-made files.
The expected figures are computed here from the raw JSON, parsed with exact decimals.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter, defaultdict
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner
from trace_data import ALL_H100, H100_TRACES

from trainscope.cli.traces import replay
from trainscope.schemas.callpath import normalise_name
from trainscope.traces.condense import condense
from trainscope.traces.reader import read_trace, trace_files

WINDOW_NS = 1_000_000_000
# The event classes and their older spellings, written out here independently of the reader.
CLASS_OF = {
    "python_function": "python_function", "user_annotation": "user_annotation",
    "gpu_user_annotation": "gpu_user_annotation", "cpu_op": "cpu_op", "operator": "cpu_op",
    "cuda_runtime": "cuda_runtime", "runtime": "cuda_runtime", "cuda_driver": "cuda_driver",
    "kernel": "kernel", "gpu_memcpy": "gpu_memcpy", "memcpy": "gpu_memcpy",
    "gpu_memset": "gpu_memset", "memset": "gpu_memset",
}


def raw_doc(path: Path) -> dict:
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rt") as handle:
        return json.load(handle, parse_float=Decimal)


def expected_totals(doc: dict) -> tuple[dict[tuple[str, str], list[int]], Counter[str]]:
    """(class, name) → [count, total ns] over the complete events of a known class."""
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    classes: Counter[str] = Counter()
    for event in doc["traceEvents"]:
        cls = CLASS_OF.get(str(event.get("cat", "")).lower())
        if event.get("ph") != "X" or cls is None:
            continue
        key = (cls, normalise_name(event["name"]))
        totals[key][0] += 1
        totals[key][1] += int(event["dur"] * 1000)  # three decimals: an exact integer
        classes[cls] += 1
    return dict(totals), classes


def got_totals(path: Path, rank: int | None = None) -> tuple[dict, object, object]:
    trace = read_trace(path, rank)
    result = condense(trace, "j", WINDOW_NS)
    from trainscope.traces.classes import CLASSES

    got: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    # Summaries do not carry the class (collectives move to their own layer), so add them up
    # per name and check the per-class figures on the columns the summaries are made from.
    for batch in result.summaries:
        for s in batch.to_summaries():
            got[("*", s.name)][0] += s.count
            got[("*", s.name)][1] += s.total_ns
    per_class: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for c, n, d in zip(trace.cls.tolist(), trace.name_id.tolist(), trace.dur_ns.tolist(),
                       strict=True):
        per_class[(CLASSES[c], trace.names[n])][0] += 1
        per_class[(CLASSES[c], trace.names[n])][1] += d
    return dict(got), dict(per_class), (trace, result)


def by_name(totals: dict[tuple[str, str], list[int]]) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for (_, name), (count, total) in totals.items():
        out[("*", name)][0] += count
        out[("*", name)][1] += total
    return dict(out)


def check_exact(path: Path, rank: int | None = None) -> tuple[object, object]:
    doc = raw_doc(path)
    expected, classes = expected_totals(doc)
    got, per_class, (trace, result) = got_totals(path, rank)
    assert per_class == expected  # every class, every name, to the nanosecond
    assert got == by_name(expected)  # and the summaries hold the same
    counts = trace.counts
    assert counts.total_read == len(doc["traceEvents"])  # every event counted ...
    assert sum(counts.kept.values()) + sum(counts.skipped.values()) == counts.total_read
    for cls, n in classes.items():  # ... and every complete event of a class kept
        assert counts.kept[cls] == n and counts.read[cls] == n
    return trace, result


def test_gloo_job_traces_are_exact_per_class_and_name(gloo_traces: Path) -> None:
    files = trace_files([gloo_traces])
    assert len(files) == 2 and any(f.name.endswith(".gz") for f in files)
    ranks = set()
    for path in files:
        # torch's handler names files host_pid.ts.pt.trace.json: the rank is not in the name
        assert re.match(r"^[^_]+_\d+\.\d+\.pt\.trace\.json", path.name)
        trace, result = check_exact(path)
        assert trace.rank_source == "distributedInfo" and trace.world_size == 2
        ranks.add(trace.rank)
        assert {"python_function", "user_annotation", "cpu_op"} <= set(trace.counts.kept)
        layers = {s.layer for b in result.summaries for s in b.to_summaries()}
        assert {"python", "user_annotation", "torch_op"} <= layers
        assert [s.step for s in result.steps] == [1, 2, 3]
    assert ranks == {0, 1}


def test_plain_export_and_handler_traces_are_exact(plain_trace: Path, handler_trace: Path):
    for path in (plain_trace, handler_trace):
        trace, _ = check_exact(path, rank=5)
        assert trace.rank == 5 and trace.rank_source == "--rank"


@pytest.mark.parametrize("path", ALL_H100, ids=lambda p: p.name[:18])
def test_every_h100_trace_is_exact_and_every_device_event_finds_its_launch(path: Path):
    trace, result = check_exact(path, rank=0)
    # Device work launched before the profiler's active window (during its warm-up) has no
    # runtime call in the trace; everything else hangs under its launch.
    events = raw_doc(path)["traceEvents"]
    launches = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    orphans = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and e["args"]["correlation"] not in launches]
    assert result.tree.unlinked_device == len(orphans)
    assert {"kernel", "gpu_memcpy", "cuda_runtime", "cpu_op"} <= set(trace.counts.kept)


@pytest.mark.parametrize("path", H100_TRACES, ids=lambda p: p.name[:12])
def test_h100_traces_hold_every_event_class(path: Path) -> None:
    trace, result = check_exact(path, rank=0)
    for cls in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "cuda_runtime",
                "cuda_driver", "cpu_op", "user_annotation"):
        assert trace.counts.kept[cls] > 0, cls
    assert trace.counts.kept["flow:ac2g"] > 0
    assert result.tree.unlinked_device == 0
    layers = {s.layer for b in result.summaries for s in b.to_summaries()}
    assert {"cuda_kernel", "memcpy", "cuda_api", "gpu_user_annotation"} <= layers


def _old_trace(tmp_path: Path, with_correlation: bool) -> Path:
    """A trace in the category spelling of torch 1.8–1.10 (hand-made)."""
    corr = (lambda c: {"correlation": c}) if with_correlation else (lambda c: {})
    events = [
        {"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 100,
         "dur": 50.125},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
         "ts": 110.5, "dur": 5.25, "args": {"correlation": 7}},
        {"ph": "X", "cat": "Kernel", "name": "volta_sgemm_128x64_nn", "pid": 0, "tid": 7,
         "ts": 120, "dur": 30.001, "args": corr(7)},
        {"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0,
         "tid": 7, "ts": 160, "dur": 4, "args": {"bytes": 4096}},
        {"ph": "X", "cat": "Memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 170,
         "dur": 1.5},
        {"ph": "s", "cat": "ac2g", "id": 7, "pid": 1, "tid": 1, "ts": 110.5},
        {"ph": "f", "cat": "ac2g", "id": 7, "pid": 0, "tid": 7, "ts": 120, "bp": "e"},
        {"ph": "X", "cat": "Mystery", "name": "x", "pid": 1, "tid": 1, "ts": 1, "dur": 1},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}},
    ]
    doc = {"distributedInfo": {"rank": 3, "world_size": 8}, "traceEvents": events,
           "baseTimeNanoseconds": 1_700_000_000_000_000_000}
    path = tmp_path / f"old-{with_correlation}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("with_correlation", [True, False])
def test_old_spellings_are_read_and_kernels_linked(tmp_path, with_correlation) -> None:
    path = _old_trace(tmp_path, with_correlation)
    trace, result = check_exact(path)
    assert trace.rank == 3
    assert trace.counts.kept == Counter({"cpu_op": 1, "cuda_runtime": 1, "kernel": 1,
                                         "gpu_memcpy": 1, "gpu_memset": 1, "flow:ac2g": 2})
    assert trace.counts.skipped == Counter({("Mystery", "not a known event class"): 1,
                                            ("metadata", "process/thread names, not timed"): 1})
    # The kernel hangs under the launch, by correlation id or, without one, by its flow.
    from trainscope.traces.cct import path_of

    tree = result.tree
    kernel = trace.names.index("volta_sgemm_128x64_nn")
    (i,) = [i for i in range(len(trace)) if trace.name_id[i] == kernel]
    assert [n for _, n in path_of(tree.nodes, int(tree.callpath[i]))] == [
        "aten::mm", "cudaLaunchKernel", "volta_sgemm_128x64_nn"]
    assert int(trace.start_ns[i]) == 1_700_000_000_000_000_000 + 120_000
    assert trace.bytes_moved.sum() == 4096


def test_the_command_prints_counts_and_an_unknown_only_trace_fails(tmp_path) -> None:
    path = _old_trace(tmp_path, True)
    result = CliRunner().invoke(replay, ["kineto", str(path)])
    assert result.exit_code == 0, result.output
    assert "rank 3 (from distributedInfo), 9 events read, 7 kept, 2 skipped" in result.output
    assert re.search(r"Mystery +1 +0 +1  not a known event class", result.output)
    # A trace of nothing the reader knows is an error, never "0 events" and exit 0.
    doc = {"traceEvents": [{"ph": "X", "cat": "Mystery", "name": "x", "ts": 1, "dur": 2}]}
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps(doc))
    result = CliRunner().invoke(replay, ["kineto", str(unknown), "--rank", "0"])
    assert result.exit_code == 1
    assert "none of its 1 events is of a known class (found: Mystery (1))" in result.output


def test_rank_is_never_guessed_from_the_file_name(handler_trace: Path, tmp_path) -> None:
    # torch's handler names the file host_pid.ts: without --rank it is an error, not rank=pid.
    result = CliRunner().invoke(replay, ["kineto", str(handler_trace)])
    assert result.exit_code == 1
    assert "cannot tell the rank" in result.output and "--rank" in result.output
    result = CliRunner().invoke(replay, ["kineto", str(handler_trace), "--rank", "4"])
    assert result.exit_code == 0 and "rank 4 (from --rank)" in result.output
    # --rank must agree with a trace's distributedInfo, and names one file only.
    old = _old_trace(tmp_path, True)
    result = CliRunner().invoke(replay, ["kineto", str(old), "--rank", "2"])
    assert result.exit_code == 1 and "disagrees with the trace's distributedInfo" in result.output
    result = CliRunner().invoke(replay, ["kineto", str(old), str(handler_trace), "--rank", "2"])
    assert result.exit_code == 2 and "one trace" in result.output
    named = tmp_path / "trace_rank7.json"
    named.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2}]}))
    result = CliRunner().invoke(replay, ["kineto", str(named)])
    assert result.exit_code == 1 and "cannot tell the rank" in result.output


def test_distributed_info_after_the_events_is_found(tmp_path) -> None:
    text = ('{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.5, '
            '"dur": 2.25}], "distributedInfo": {"rank": 6}, "baseTimeNanoseconds": 1000}')
    path = tmp_path / "late.json.gz"
    path.write_bytes(gzip.compress(text.encode()))
    trace = read_trace(path)
    assert (trace.rank, trace.base_ns, int(trace.start_ns[0]), int(trace.dur_ns[0])) == (
        6, 1000, 2500, 2250)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', "invalid JSON near byte"),
        (gzip.compress(b'{"traceEvents": []}' * 50, mtime=0)[:40], "truncated gzip"),
        (b'{"events": []}', "no 'traceEvents' list"),
        (b'[{"ph": "X"}]', "the top level is not an object"),
        (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": "soon", "dur": 1}]}',
         "traceEvents[0]"),
        (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 1, "dur": 1}]}',
         "cannot tell the rank"),
        (b'{"distributedInfo": {"rank": 0}, "traceEvents": []}', "holds no events"),
    ],
)
def test_malformed_files_give_one_clear_line(tmp_path, content, expected) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(content)
    result = CliRunner().invoke(replay, ["kineto", str(path)])
    assert result.exit_code == 1
    message = result.output.strip()
    assert message.startswith("Error: ") and len(message.splitlines()) == 1, message
    assert str(path) in message and expected in message


def test_names_that_differ_only_in_an_address_are_one_function(tmp_path) -> None:
    events = [{"ph": "X", "cat": "python_function", "pid": 1, "tid": 1, "ts": k * 10,
               "dur": 1 + k, "name": f"<built-in method sum of Tensor object at 0x7f{k:04x}>"}
              for k in range(3)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"distributedInfo": {"rank": 0}, "traceEvents": events}))
    result = condense(read_trace(path), "j", WINDOW_NS)
    (summary,) = [s for b in result.summaries for s in b.to_summaries()]
    assert (summary.name, summary.count, summary.total_ns) == (
        "<built-in method sum of Tensor>", 3, 6000)
