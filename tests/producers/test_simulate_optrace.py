"""The simulated cluster's op traces, analysed by the what-if module end to end.

The simulator is the "real cluster" here and the what-if module the analysis: a healthy job must
look healthy, an injected slow GPU must be found as the slow worker, an injected stage imbalance
as stage partitioning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.optrace import JobMeta, validate
from trainscope.whatif.analysis import WhatIf, analyse
from trainscope.whatif.layout import build_layout

TRACE_COLUMNS = [
    "dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id", "mc", "gmc",
    "mb_id",
]
DP, PP, TP, STEPS, MICROBATCHES = 4, 4, 2, 30, 8


def spec(seed: int = 0) -> ClusterSpec:
    return ClusterSpec(
        dp=DP, pp=PP, tp=TP, steps=STEPS, microbatches=MICROBATCHES, seed=seed, record_ops=True
    )


def trace_of(cluster_spec: ClusterSpec, faults: tuple[str, ...] = ()) -> pd.DataFrame:
    frames = [out.ops for out in SimulatedCluster(cluster_spec, parse_faults(faults)).run()]
    assert all(f is not None for f in frames)
    return pd.concat(frames, ignore_index=True)


def analyse_trace(df: pd.DataFrame, cluster_spec: ClusterSpec) -> WhatIf:
    meta = JobMeta.from_mapping(cluster_spec.op_trace_meta())
    layout = build_layout(validate(df, meta, "simulated"), meta, "simulated")
    assert layout.dropped_steps == [], layout.warnings
    return analyse(layout)


@pytest.fixture(scope="module")
def healthy() -> pd.DataFrame:
    return trace_of(spec())


def test_ops_are_off_by_default() -> None:
    quiet = ClusterSpec(dp=2, pp=2, tp=1, steps=2)
    assert all(out.ops is None for out in SimulatedCluster(quiet).run())


def test_trace_has_the_megatron_model(healthy: pd.DataFrame) -> None:
    assert list(healthy.columns) == TRACE_COLUMNS
    # Per worker and step: F/B compute per micro-batch, a recv/send per compute except at the
    # pipeline ends, one DP all-reduce and one optimizer.
    per_step = 2 * MICROBATCHES * DP * PP + 2 * 2 * MICROBATCHES * DP * (PP - 1) + 2 * DP * PP
    assert len(healthy) == per_step * STEPS
    assert set(healthy["optype"].astype(str)) == {
        "forward-compute", "backward-compute", "forward-send", "forward-recv", "backward-send",
        "backward-recv", "separate-grads-all-reduce", "optimizer",
    }
    # One worker per (dp_rank, stage), seen from tp_rank 0.
    expected_rank = (healthy["dp_rank"] + DP * healthy["stage"]) * TP
    assert (healthy["rank"] == expected_rank).all()
    # A receive whose data has already arrived takes no time; everything else does.
    recv = healthy["optype"].astype(str).str.endswith("-recv")
    assert (healthy.loc[~recv, "duration"] > 0).all()
    assert (healthy.loc[recv, "duration"] >= 0).all()
    # seq_id is 0, 1, 2, ... in start order within (worker, step, optype).
    keys = ["dp_rank", "stage", "step", "optype"]
    ordered = healthy.sort_values([*keys, "start_ts"], kind="stable")
    expected_seq = ordered.groupby(keys, observed=True).cumcount()
    assert (ordered["seq_id"].to_numpy() == expected_seq.to_numpy()).all()
    compute = healthy["optype"].astype(str).str.endswith("-compute")
    assert healthy.loc[compute, "mb_id"].notna().all()
    assert healthy.loc[~compute, "mb_id"].isna().all()
    # Each worker's ops follow one another: the next op starts when the previous one ends.
    by_worker = healthy.sort_values(["step", "stage", "dp_rank", "start_ts"])
    gap = by_worker["start_ts"].shift(-1) - (by_worker["start_ts"] + by_worker["duration"])
    same = (by_worker[["step", "stage", "dp_rank"]].shift(-1) == by_worker[["step", "stage",
                                                                          "dp_rank"]]).all(axis=1)
    assert np.abs(gap[same]).max() < 1e-6


def test_compute_ops_include_the_tp_all_reduce(healthy: pd.DataFrame) -> None:
    cluster_spec = spec()
    forward = healthy.loc[healthy["optype"] == "forward-compute", "duration"]
    # Megatron's timer around a layer's forward covers its TP all-reduce (1.2 ms here, well
    # above the 2% jitter of the 24 ms compute).
    floor_s = (cluster_spec.forward_ms + 0.5 * cluster_spec.tp_allreduce_ms) * 1e-3
    assert forward.median() > floor_s


def test_healthy_job_is_not_slowed_by_stragglers(healthy: pd.DataFrame) -> None:
    result = analyse_trace(healthy, spec())
    assert result.steps == STEPS and result.workers == DP * PP
    assert abs(result.S - 1.0) < 0.03, result.S
    assert result.sim_error_median < 0.02, result.sim_error_median


def test_slow_gpu_is_the_first_suspect_worker() -> None:
    cluster_spec = spec(seed=1)
    slow_rank = 13  # dp_rank 2, stage 1, tp_rank 1: the TP peer hides inside its worker's ops
    dp_rank, stage, tp_rank = cluster_spec.layout.coords(slow_rank)
    assert tp_rank != 0
    result = analyse_trace(trace_of(cluster_spec, (f"slow-gpu:rank={slow_rank},factor=1.5",)),
                           cluster_spec)
    first = result.S_worker[0]
    assert (first["dp_rank"], first["stage"]) == (dp_rank, stage), result.S_worker[:3]
    assert result.S > 1.05, result.S
    assert result.M_W > 0.5, result.M_W
    assert result.M_S < 0.5, result.M_S


def test_stage_imbalance_is_stage_partitioning() -> None:
    cluster_spec = spec(seed=2)
    result = analyse_trace(trace_of(cluster_spec, (f"stage-imbalance:stage={PP - 1},factor=1.3",)),
                           cluster_spec)
    assert result.S > 1.05, result.S
    assert result.M_S > 0.8, result.M_S
    assert result.M_W < 0.5, result.M_W
    assert max(result.S_stage, key=result.S_stage.get) == PP - 1, result.S_stage


def trainscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )


def test_demo_optrace_then_whatif_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "trace"
    demo = trainscope(
        "demo", "--no-store", "--steps", "30", "--dp", "4", "--pp", "4", "--tp", "2",
        "--fault", "slow-gpu:rank=13,factor=1.5", "--json", "--optrace", str(out),
    )
    assert demo.returncode == 0, demo.stderr
    json.loads(demo.stdout)  # the demo's own JSON is still the only thing on stdout
    trace, meta = out / "optrace.parquet", out / "optrace.yaml"
    assert f"trainscope whatif --trace {trace} --meta {meta}" in demo.stderr
    assert trace.is_file() and meta.is_file()

    done = trainscope("whatif", "--trace", str(trace), "--meta", str(meta), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["steps"] == 30 and result["workers"] == 16
    assert result["sim_error_median"] < 0.02
    assert result["S"] > 1.05
    assert (result["S_worker"][0]["dp_rank"], result["S_worker"][0]["stage"]) == (2, 1)
