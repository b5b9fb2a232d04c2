"""Read PyTorch profiler (Kineto) Chrome traces and condense them into function summaries.

A trace file holds one rank's events (``traceEvents``) with ``ts``/``dur`` in microseconds
relative to ``baseTimeNanoseconds``. Each complete event (``ph: X``) becomes one execution of a
function in a layer: ``python_function`` → python, ``cpu_op`` → torch_op, ``kernel`` →
cuda_kernel, ``gpu_memcpy``/``gpu_memset`` → memcpy, ``cuda_runtime``/``cuda_driver`` →
cuda_api; collectives (NCCL kernels, ``c10d::``/``nccl:``/``gloo:`` ops) → collective.
``ProfilerStep#N`` annotations become step records.

Call paths are built as live (:func:`trainscope.schemas.callpath.callpath_id`): a CPU
event's parent is the innermost event enclosing it on the same thread, a device event's parent
is the runtime call with the same ``correlation`` id.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscope.schemas.callpath import callpath_id, normalise_name
from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.records import StepRecord, SummaryBatch
from trainscope.schemas.summaries import FunctionKey, summary_batches

CATEGORY_LAYERS = {
    "python_function": "python",
    "cpu_op": "torch_op",
    "kernel": "cuda_kernel",
    "gpu_memcpy": "memcpy",
    "gpu_memset": "memcpy",
    "cuda_runtime": "cuda_api",
    "cuda_driver": "cuda_api",
}
_COLLECTIVE_PREFIXES = ("c10d::", "nccl:", "gloo:", "record_param_comms")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_TRAILING_NUMBER = re.compile(r"(\d+)$")
TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")


class KinetoError(ValueError, TrainscopeError):
    """A trace that cannot be read; the message names the file and the position."""


@dataclass
class RankTrace:
    path: Path
    rank: int
    world_size: int
    base_ns: int
    events: list[dict[str, Any]]


@dataclass
class ReplayResult:
    summaries: list[SummaryBatch] = field(default_factory=list)  # one or more per window
    steps: list[StepRecord] = field(default_factory=list)
    events: int = 0
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> events


def trace_files(paths: list[str | Path]) -> list[Path]:
    """Expand directories into the trace files they contain (sorted)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise KinetoError(f"{path}: directory holds no *.json or *.json.gz trace")
            out.extend(found)
        elif path.exists():
            out.append(path)
        else:
            raise KinetoError(f"{path}: no such file or directory")
    return out


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        decompressor = zlib.decompressobj(wbits=31)
        try:
            data = decompressor.decompress(raw)
        except zlib.error as exc:
            raise KinetoError(f"{path}: corrupt gzip data ({exc})") from None
        if not decompressor.eof:
            raise KinetoError(
                f"{path}: truncated gzip file: the compressed stream ends at byte {len(raw)} "
                f"after {len(data)} bytes of JSON"
            )
    else:
        data = raw
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KinetoError(f"{path}: not UTF-8 text at byte {exc.start}") from None


def load(path: Path, rank: int | None = None) -> RankTrace:
    text = _read_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise KinetoError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno} (char {exc.pos}): "
            f"{exc.msg}" + (" — the file looks truncated" if exc.pos >= len(text) - 1 else "")
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise KinetoError(f"{path}: not a Chrome trace: no 'traceEvents' list at the top level")
    info = doc.get("distributedInfo") or {}
    if rank is None:
        rank = _rank_of(path, info)
    base_ns = doc.get("baseTimeNanoseconds", 0)
    if not isinstance(base_ns, int):
        raise KinetoError(f"{path}: baseTimeNanoseconds is {base_ns!r}, expected an integer")
    world = info.get("world_size", 0) if isinstance(info, dict) else 0
    return RankTrace(path, rank, int(world or 0), base_ns, doc["traceEvents"])


def _rank_of(path: Path, info: Any) -> int:
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    stem = path.name.split(".")[0]
    match = _RANK_IN_NAME.search(path.name) or _TRAILING_NUMBER.search(stem)
    if match:
        return int(match.group(1))
    raise KinetoError(
        f"{path}: cannot tell the rank: no distributedInfo in the trace and no rank in the file "
        "name (e.g. trace_rank3.json); pass --rank"
    )


def layer_of(category: str, name: str) -> str | None:
    layer = CATEGORY_LAYERS.get(category)
    if layer is None:
        if category == "user_annotation" and name.startswith(_COLLECTIVE_PREFIXES):
            return "collective"
        return None
    if layer == "torch_op" and name.startswith(_COLLECTIVE_PREFIXES):
        return "collective"
    if layer == "cuda_kernel" and name.lower().startswith("nccl"):
        return "collective"
    return layer


def _complete_events(trace: RankTrace) -> Iterator[tuple[int, dict[str, Any]]]:
    for index, event in enumerate(trace.events):
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        ts, dur, name = event.get("ts"), event.get("dur"), event.get("name")
        if not isinstance(name, str) or not isinstance(ts, int | float) or not isinstance(
            dur, int | float
        ):
            raise KinetoError(
                f"{trace.path}: traceEvents[{index}] is a complete event without a valid "
                f"name/ts/dur: {json.dumps(event)[:120]}"
            )
        yield index, event


def condense(trace: RankTrace, job_id: str, window_ns: int) -> ReplayResult:
    """Summaries per (window, layer, name, call path) and step records of one rank's trace."""
    result = ReplayResult()
    durations: dict[tuple[int, str, str, int], list[int]] = {}
    # CPU events per thread, sorted so that an enclosing event comes before what it encloses.
    by_thread: dict[tuple[Any, Any], list[tuple[int, int, str, str]]] = {}
    device: list[tuple[int, int, str, str, Any]] = []
    for _, event in _complete_events(trace):
        start = trace.base_ns + round(event["ts"] * 1000)
        duration = max(0, round(event["dur"] * 1000))
        name = event["name"]
        category = event.get("cat", "")
        step = _STEP.match(name)
        if step:
            result.steps.append(
                StepRecord(job_id=job_id, rank=trace.rank, step=int(step.group(1)),
                           start_ns=start, duration_ns=duration)
            )
            continue
        layer = layer_of(category, name)
        if layer is None:
            continue
        name = normalise_name(name)
        if layer in ("cuda_kernel", "memcpy") or (layer == "collective" and category == "kernel"):
            correlation = (event.get("args") or {}).get("correlation")
            device.append((start, duration, layer, name, correlation))
        else:
            key = (event.get("pid"), event.get("tid"))
            by_thread.setdefault(key, []).append((start, duration, layer, name))
    launches: dict[Any, int] = {}

    def add(start: int, duration: int, layer: str, name: str, cp: int) -> None:
        window = start // window_ns * window_ns
        durations.setdefault((window, layer, name, cp), []).append(duration)
        result.events += 1

    for (pid, tid), events in by_thread.items():
        events.sort(key=lambda e: (e[0], -e[1]))
        stack: list[tuple[int, int]] = []  # (end_ns, callpath id)
        for start, duration, layer, name in events:
            while stack and stack[-1][0] <= start:
                stack.pop()
            parent = stack[-1][1] if stack else 0
            cp = callpath_id(parent, layer, name)
            add(start, duration, layer, name, cp)
            stack.append((start + duration, cp))
            if layer == "cuda_api":
                launches.setdefault((pid, tid, start), cp)
    runtime_by_correlation = _runtime_correlations(trace, launches)
    for start, duration, layer, name, correlation in device:
        parent = runtime_by_correlation.get(correlation, 0)
        add(start, duration, layer, name, callpath_id(parent, layer, name))
    result.ranks[trace.rank] = result.events
    by_window: dict[int, dict[FunctionKey, list[int]]] = {}
    for (window, layer, name, cp), values in durations.items():
        by_window.setdefault(window, {})[(layer, name, cp)] = values
    result.summaries = [
        batch
        for window, functions in sorted(by_window.items())
        for batch in summary_batches(functions, job_id=job_id, rank=trace.rank,
                                     window_start_ns=window, window_end_ns=window + window_ns)
    ]
    return result


def _runtime_correlations(trace: RankTrace, launches: dict[Any, int]) -> dict[Any, int]:
    """correlation id → call path of the runtime call (cudaLaunchKernel) that carries it."""
    out: dict[Any, int] = {}
    for _, event in _complete_events(trace):
        if event.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        correlation = (event.get("args") or {}).get("correlation")
        start = trace.base_ns + round(event["ts"] * 1000)
        cp = launches.get((event.get("pid"), event.get("tid"), start))
        if correlation is not None and cp is not None:
            out[correlation] = cp
    return out

