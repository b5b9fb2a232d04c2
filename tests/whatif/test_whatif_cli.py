import json

import numpy as np
from click.testing import CliRunner

from trainscope.cli.whatif import whatif
from trainscope.whatif.generate import JobSpec

KEYS = {
    "S",
    "S_per_step",
    "S_optype",
    "S_dp_rank",
    "S_stage",
    "S_worker",
    "M_W",
    "M_S",
    "sim_error_median",
    "sim_error_p90",
    "steps",
    "workers",
}
SLOW_STAGE = JobSpec(dp_size=4, pp_size=3, steps=[1, 2, 5], stage_factor={2: 1.4}, seed=11)


def run(*args):
    return CliRunner().invoke(whatif, [str(a) for a in args])


def test_json_output_is_one_object_with_the_promised_keys(trace_files):
    trace, meta = trace_files(SLOW_STAGE)
    result = run("--trace", trace, "--meta", meta, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) >= KEYS
    assert data["steps"] == 3 and data["workers"] == 12
    assert set(data["S_per_step"]) == {"1", "2", "5"}
    assert set(data["S_stage"]) == {"0", "1", "2"} and len(data["S_dp_rank"]) == 4
    assert data["S_worker"][0]["stage"] == 2
    assert set(data["S_worker"][0]) == {"dp_rank", "stage", "score"}
    scores = [w["score"] for w in data["S_worker"]]
    assert scores == sorted(scores, reverse=True)
    assert data["M_S"] > 0.8


def test_report_says_what_the_numbers_mean(trace_files):
    trace, meta = trace_files(SLOW_STAGE, ".csv")
    result = run("--trace", trace, "--meta", meta)
    assert result.exit_code == 0, result.output
    assert "slower than the ideal run" in result.stdout
    assert "Stage partitioning imbalance is the main cause" in result.stdout
    assert "fixing the last pipeline stage removes" in result.stdout


def test_heatmap_and_timeline(trace_files, tmp_path):
    trace, meta = trace_files(SLOW_STAGE)
    png, timeline = tmp_path / "scores.png", tmp_path / "tl"
    result = run(
        "--trace", trace, "--meta", meta, "--json", "--heatmap", png, "--timeline", timeline
    )
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # side outputs never leak into stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (path,) = timeline.glob("*.json")
    trace_json = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace_json["traceEvents"] if e["name"] == "process_name"}
    assert {"stage 2 · dp 3 · real", "stage 2 · dp 3 · ideal"} <= names
    assert trace_json["otherData"]["steps"] == [1, 2, 5]


def test_missing_column_is_one_clear_line(trace_files):
    trace, meta = trace_files(SLOW_STAGE, df=lambda df: df.drop(columns=["optype"]))
    result = run("--trace", trace, "--meta", meta, "--json")
    assert result.exit_code != 0
    assert result.stdout == ""
    assert "missing column(s) 'optype'" in result.stderr
    assert str(trace) in result.stderr
    assert "Traceback" not in result.output and result.exception.__class__ is SystemExit


def test_unknown_optype_and_world_size(trace_files):
    def rename(df):
        df["optype"] = df["optype"].astype(str).replace("optimizer", "optimiser")
        return df

    trace, meta = trace_files(SLOW_STAGE, ".csv", df=rename)
    result = run("--trace", trace, "--meta", meta)
    assert result.exit_code != 0 and "unknown optype 'optimiser'" in result.stderr

    trace, meta = trace_files(SLOW_STAGE, meta={**SLOW_STAGE.meta(), "world_size": 99})
    result = run("--trace", trace, "--meta", meta)
    assert result.exit_code != 0 and "world_size 99 does not match" in result.stderr


def test_dropped_step_is_warned_and_counted(trace_files):
    def drop(df):
        gone = (df["step"] == 2) & (df["optype"] == "optimizer") & (df["dp_rank"] == 3)
        return df[~(gone & (df["stage"] == 1))]

    trace, meta = trace_files(SLOW_STAGE, df=drop)
    result = run("--trace", trace, "--meta", meta, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["steps"] == 2 and data["steps_dropped"] == [2]
    assert "step 2: worker (dp_rank 3, stage 1) has no optimizer op" in result.stderr


def test_usage_errors():
    assert run().exit_code == 2
    assert "needs --meta" in run("--trace", "x.parquet").output
    result = run("--job", "j")
    assert result.exit_code != 0 and "needs a store" in result.output


def test_scores_are_finite(trace_files):
    trace, meta = trace_files(JobSpec(dp_size=2, pp_size=2, steps=2, seed=12))
    data = json.loads(run("--trace", trace, "--meta", meta, "--json").stdout)
    assert np.isfinite([w["score"] for w in data["S_worker"]]).all()
