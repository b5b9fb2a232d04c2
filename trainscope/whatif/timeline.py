"""Chrome Trace Event Format timeline of the real run and the ideal run, side by side.

Open the file in https://ui.perfetto.dev or chrome://tracing. Every worker (stage, DP rank) is
two processes next to each other, "real" (the observed ops) and "ideal" (the replay with every
op at its typical duration), over all analysed steps. Each process has one thread per stream of
the dependency model: compute (with the ops after the last backward: gc, layernorm and
embedding all-reduce, clip, optimizer), the four point-to-point streams and data-parallel
communication. Ops of one stream never overlap; where the recorded times overlap by rounding,
the earlier slice is trimmed to the later one's start (``args.trimmed``).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from trainscope.schemas import optypes as ot
from trainscope.whatif.analysis import WhatIf, layout_graph
from trainscope.whatif.graph import Graph
from trainscope.whatif.layout import Layout
from trainscope.whatif.simulate import simulate

# Beyond this many DP ranks a timeline is unreadable; the most suspect ranks are kept.
MAX_DP_RANKS = 64
FILE_NAME = "whatif_timeline.json"
STREAMS: tuple[str, ...] = (
    "compute",
    "forward-send",
    "forward-recv",
    "backward-send",
    "backward-recv",
    "dp comm",
)
_STREAM_OF: dict[int, int] = {
    **{code: 0 for code in ot.CODE.values()},
    **{code: STREAMS.index(ot.OPTYPES[code]) for code in ot.P2P},
    **{code: STREAMS.index("dp comm") for code in ot.DP_COLLECTIVES},
}
# Gap between steps laid out back to back (traces whose steps share one time origin).
STEP_GAP_S = 0.01
RUNS = ("real", "ideal")


def chrome_trace(layout: Layout, result: WhatIf, graph: Graph | None = None) -> dict[str, Any]:
    if result.ideal_effective_s is None:
        raise ValueError("the result carries no ideal durations; run analyse() on this layout")
    graph = graph or layout_graph(layout)
    ideal = simulate(graph, result.ideal_effective_s[:, None, None], (1, 1), keep_times=True)
    assert ideal.start_s is not None and ideal.end_s is not None
    ideal_start = ideal.start_s[:, 0, 0]
    ideal_end = ideal.end_s[:, 0, 0]
    offsets = _step_offsets(layout, float(ideal_end.max()))
    dp_ranks = _chosen_dp_ranks(result, layout.meta.dp_size)
    stream = np.array([_STREAM_OF[int(c)] for c in layout.node_op])

    events: list[dict[str, Any]] = []
    for s in range(layout.meta.pp_size):
        nodes = np.flatnonzero(layout.node_stage == s)
        for d in dp_ranks:
            worker = s * layout.meta.dp_size + d
            for r, run in enumerate(RUNS):
                pid = 2 * worker + r + 1
                events += _process_metadata(pid, f"stage {s} · dp {d} · {run}")
                for i, step in enumerate(layout.step_ids.tolist()):
                    if run == "real":
                        start = layout.start_s[nodes, i, d]
                        end = start + layout.duration_s[nodes, i, d]
                    else:
                        start, end = ideal_start[nodes], ideal_end[nodes]
                    for n, a, b in zip(nodes, start + offsets[i], end + offsets[i], strict=True):
                        args = {"step": step, "seq_id": int(layout.node_seq[n])}
                        if graph.noop[n]:
                            args["never_launched"] = True
                        events.append(
                            _slice(ot.OPTYPES[layout.node_op[n]], pid, int(stream[n]), a, b, args)
                        )
    _trim_overlaps(events)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "S": result.S,
            "M_W": result.M_W,
            "M_S": result.M_S,
            "steps": [int(s) for s in layout.step_ids],
            "dp_ranks_shown": len(dp_ranks),
        },
    }


def write_timeline(layout: Layout, result: WhatIf, directory: str | Path) -> Path:
    trace = chrome_trace(layout, result)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILE_NAME
    path.write_text(json.dumps(trace, allow_nan=False, default=_json_number))
    return path


def _json_number(x: Any) -> Any:
    return float(x)


def _step_offsets(layout: Layout, ideal_step_s: float) -> np.ndarray:
    """Where each step starts on the timeline (seconds from the first step): at its real time,
    or right after the previous step where real steps would overlap (steps recorded with a
    time origin per step)."""
    real_span = (layout.start_s + layout.duration_s).max(axis=(0, 2))
    span = np.maximum(real_span, ideal_step_s) + STEP_GAP_S
    origin = layout.step_origin_s - layout.step_origin_s[0]
    offsets = np.zeros(len(origin))
    for i in range(1, len(origin)):
        offsets[i] = max(origin[i], offsets[i - 1] + span[i - 1])
    return offsets


def _chosen_dp_ranks(result: WhatIf, dp_size: int) -> list[int]:
    if dp_size <= MAX_DP_RANKS:
        return list(range(dp_size))
    ranked = sorted(result.S_dp_rank, key=lambda d: -result.S_dp_rank[d])
    return sorted(ranked[:MAX_DP_RANKS])


def _process_metadata(pid: int, name: str) -> list[dict[str, Any]]:
    events = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": pid},
        },
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": stream}}
        for tid, stream in enumerate(STREAMS)
    ]
    return events


def _slice(
    name: str, pid: int, tid: int, start_s: float, end_s: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": STREAMS[tid],
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": round(float(start_s) * 1e6, 3),
        "dur": round(max(float(end_s) - float(start_s), 0.0) * 1e6, 3),
        "args": args,
    }


def _trim_overlaps(events: list[dict[str, Any]]) -> None:
    slices = sorted(
        (e for e in events if e["ph"] == "X"), key=lambda e: (e["pid"], e["tid"], e["ts"])
    )
    for prev, nxt in itertools.pairwise(slices):
        if (prev["pid"], prev["tid"]) != (nxt["pid"], nxt["tid"]):
            continue
        if prev["ts"] + prev["dur"] > nxt["ts"]:
            prev["dur"] = max(round(nxt["ts"] - prev["ts"], 3), 0.0)
            prev["args"]["trimmed"] = True
