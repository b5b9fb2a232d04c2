"""A real production op trace through the online detectors: ``trainscope replay optrace``.

The ST trace of the straggler study (8 workers, dp 2 × pp 4; its published analysis puts the
slowdown in pipeline stage 3) is published with ``trainscope replay optrace`` over the real
broker, and ``trainscope pipeline`` runs as its own process. The stream job must name stage 3
as a stage imbalance, alert no rank beside it (the ranks of that stage, and those waiting for
it, are the same fault), and give the stage's compute per step within 5% of the trace's own.
The same run stores the op trace: ``trainscope whatif --job ST`` on the pipeline's store then
gives the what-if of the trace file.
"""

from __future__ import annotations

import ast
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from pipeline_procs import PipelineProcess, diagnose_store, dump_tables, what_if

from trainscope.detectors.base import ALERT_THRESHOLD

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

DATA = Path(__file__).resolve().parents[2] / "data" / "stragglers-ST"
WINDOW_S = 10.0
COMPUTE = ("forward-compute", "backward-compute", "optimizer", "gc")


def _trace_compute_ms_per_step() -> dict[int, float]:
    """Each stage's compute per worker and step, from the trace itself."""
    frame = pd.read_parquet(DATA / "trace-ST.parquet")
    compute = frame[frame["optype"].astype(str).isin(COMPUTE)]
    steps = frame["step"].nunique()
    workers = frame.groupby("stage")["rank"].nunique()
    per_stage = compute.groupby("stage")["duration"].sum() / steps / workers * 1e3
    return {int(s): float(v) for s, v in per_stage.items()}


def test_the_st_trace_replayed_names_stage_3_once_with_its_own_cost(
        fresh_kafka_broker, tmp_path: Path) -> None:
    store = tmp_path / "store"
    pipeline = PipelineProcess(
        fresh_kafka_broker.url, store, "pipeline-st",
        "--window-s", str(WINDOW_S), "--lateness-s", "2", "--commit-interval-s", "1",
        "--close-idle-s", "3", "--source-idle-s", "1", "--drain-on-stop",
        logs=tmp_path / "pipeline",
    )
    try:
        replayed = subprocess.run(
            [sys.executable, "-m", "trainscope.cli.main", "replay", "optrace",
             str(DATA / "trace-ST.parquet"), "--meta", str(DATA / "meta-ST.yaml"),
             "--job", "ST", "--bus", fresh_kafka_broker.url, "--window-s", str(WINDOW_S)],
            capture_output=True, text=True, timeout=120, check=False)
        assert replayed.returncode == 0, replayed.stderr
        assert "records of job ST" in replayed.stdout, replayed.stdout
        deadline = time.monotonic() + 60  # every window closed (--close-idle-s 3)
        while "stage-imbalance" not in pipeline.out_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)
        # While the pipeline runs, and owns the store: read through its read endpoint.
        live, note = what_if("--job", "ST", "--store", str(store))
        assert "result not stored: process" in note, note
        assert pipeline.terminate() == 0, pipeline.err_text()[-3000:]
    finally:
        if pipeline.process.poll() is None:
            pipeline.kill()
    stats = pipeline.stats()
    assert stats["validate"]["rejected"] == 0 and stats["window"]["dropped"] == 0, stats
    ops = len(pd.read_parquet(DATA / "trace-ST.parquet"))
    assert stats["op_traces"] == {"received": ops, "emitted": ops, "rejected": 0,
                                  "dropped": 0}, stats
    _check_what_if_from_the_store(store, live)

    diagnosis = diagnose_store(store, "ST")
    print(f"\n{diagnosis}")
    suspects = [(s["category"], s["ranks"]) for s in diagnosis["suspects"]]
    assert suspects == [("stage-imbalance", [6, 7])], diagnosis
    rows = [ast.literal_eval(r) for r in dump_tables(store, ("findings",))["findings"]]
    columns = ["job_id", "window_start_ns", "window_end_ns", "detector", "rank", "ranks",
               "victims", "pp_stage", "layer", "function", "category", "score", "evidence",
               "message"]
    findings = [dict(zip(columns, r[1:], strict=False)) for r in rows]
    alerts = [f for f in findings if f["job_id"] == "ST" and f["score"] >= ALERT_THRESHOLD]
    assert alerts and all(f["category"] == "stage-imbalance" and f["pp_stage"] == 3
                          for f in alerts), [(f["detector"], f["rank"], f["category"])
                                             for f in alerts]
    # Whole windows only (the first and the last hold part of the trace's steps).
    trace_ms = _trace_compute_ms_per_step()
    others_ms = statistics.median(v for s, v in trace_ms.items() if s != 3)
    measured = [(f["evidence"]["value_ns_per_step"] / 1e6,
                 f["evidence"]["reference_ns_per_step"] / 1e6) for f in alerts]
    print(f"trace: stage 3 {trace_ms[3]:.0f} ms/step, other stages {others_ms:.0f}; "
          f"windows: {[(round(v), round(r)) for v, r in measured]}")
    for value_ms, reference_ms in measured:
        assert abs(value_ms / trace_ms[3] - 1) <= 0.05, (value_ms, trace_ms)
        assert abs(reference_ms / others_ms - 1) <= 0.05, (reference_ms, trace_ms)


def _check_what_if_from_the_store(store: Path, live: dict) -> None:
    """The what-if from the store the pipeline wrote, while it ran (``live``) and after, is
    the trace file's; after, it is kept in whatif_results."""
    from_store, note = what_if("--job", "ST", "--store", str(store))
    assert "result stored in whatif_results for job 'ST'" in note, note
    from_file, _ = what_if("--trace", str(DATA / "trace-ST.parquet"), "--meta",
                            str(DATA / "meta-ST.yaml"))
    print(f"what-if S: from the pipeline's store {from_store['S']:.4f} (while it ran "
          f"{live['S']:.4f}), from the file {from_file['S']:.4f}")
    assert from_store == from_file == live
