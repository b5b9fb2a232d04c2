"""Chrome / Perfetto trace JSON of one step: the real run and the ideal run side by side.

Open the file in https://ui.perfetto.dev or chrome://tracing. Process "real run" holds the
observed ops, process "ideal run" the replay with every op at its typical duration; each
worker is one thread, named by its stage and DP rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trainscope.whatif.analysis import WhatIf, layout_graph
from trainscope.whatif.graph import Graph
from trainscope.whatif.layout import Layout
from trainscope.whatif.optypes import OPTYPES
from trainscope.whatif.simulate import simulate

# Beyond this many DP ranks a timeline is unreadable; the most suspect ranks are kept.
MAX_DP_RANKS = 64
REAL_PID, IDEAL_PID = 1, 2


def chrome_trace(
    layout: Layout, result: WhatIf, step: int | None = None, graph: Graph | None = None
) -> dict[str, Any]:
    if result.ideal_effective_s is None:
        raise ValueError("the result carries no ideal durations; run analyse() on this layout")
    if step is None:
        step = max(result.S_per_step, key=lambda k: result.S_per_step[k])
    s_idx = int(np.searchsorted(layout.step_ids, step))
    if s_idx >= len(layout.step_ids) or layout.step_ids[s_idx] != step:
        raise ValueError(f"step {step} is not among the analysed steps")
    graph = graph or layout_graph(layout)
    ideal = simulate(graph, result.ideal_effective_s[:, None, None], (1, 1), keep_times=True)
    assert ideal.start_s is not None and ideal.end_s is not None
    dp_ranks = _chosen_dp_ranks(result, layout.meta.dp_size)

    events: list[dict[str, Any]] = [
        _meta("process_name", REAL_PID, 0, f"real run (step {step})"),
        _meta("process_name", IDEAL_PID, 0, "ideal run"),
    ]
    for s in range(layout.meta.pp_size):
        lo, hi = int(layout.stage_offsets[s]), int(layout.stage_offsets[s + 1])
        for d in dp_ranks:
            tid = s * layout.meta.dp_size + d
            for pid in (REAL_PID, IDEAL_PID):
                events.append(_meta("thread_name", pid, tid, f"stage {s} · dp {d}"))
            for n in range(lo, hi):
                name = OPTYPES[layout.node_op[n]]
                args = {"seq_id": int(layout.node_seq[n])}
                start = float(layout.start_s[n, s_idx, d])
                events.append(
                    _span(name, REAL_PID, tid, start, float(layout.duration_s[n, s_idx, d]), args)
                )
                i_start = float(ideal.start_s[n, 0, 0])
                events.append(
                    _span(
                        name, IDEAL_PID, tid, i_start, float(ideal.end_s[n, 0, 0]) - i_start, args
                    )
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"step": int(step), "S": result.S, "dp_ranks_shown": len(dp_ranks)},
    }


def write_timeline(
    layout: Layout, result: WhatIf, directory: str | Path, step: int | None = None
) -> Path:
    trace = chrome_trace(layout, result, step)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"whatif_step_{trace['otherData']['step']}.json"
    path.write_text(json.dumps(trace))
    return path


def _chosen_dp_ranks(result: WhatIf, dp_size: int) -> list[int]:
    if dp_size <= MAX_DP_RANKS:
        return list(range(dp_size))
    ranked = sorted(result.S_dp_rank, key=lambda d: -result.S_dp_rank[d])
    return sorted(ranked[:MAX_DP_RANKS])


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _span(
    name: str, pid: int, tid: int, start_s: float, duration_s: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start_s * 1e6,
        "dur": max(duration_s, 0.0) * 1e6,
        "args": args,
    }
