"""Malformed input gives a clear error naming the problem, or a warning and a dropped step."""

import numpy as np
import pytest

from trainscope.schemas.optrace import JobMeta, TraceError, load_trace, read_meta, validate
from trainscope.whatif.generate import JobSpec, generate
from trainscope.whatif.layout import build_layout

SPEC = JobSpec(dp_size=2, pp_size=2, microbatches=4, steps=[3, 5, 9])


def meta_of(**changes) -> JobMeta:
    return JobMeta.from_mapping({**SPEC.meta(), **changes})


def test_missing_column_is_named():
    df, _ = generate(SPEC)
    with pytest.raises(TraceError, match=r"x\.parquet: missing column\(s\) 'seq_id'"):
        validate(df.drop(columns=["seq_id"]), meta_of(), "x.parquet")


def test_unknown_optype_is_named_with_its_row():
    df, _ = generate(SPEC)
    df["optype"] = df["optype"].astype(str)
    df.loc[7, "optype"] = "forward-teleport"
    with pytest.raises(TraceError, match=r"unknown optype 'forward-teleport' \(row 7\)"):
        validate(df, meta_of(), "t")


def test_world_size_mismatch():
    with pytest.raises(TraceError, match=r"world_size 8 does not match .* = 4"):
        meta_of(world_size=8)


def test_trace_workers_must_match_metadata():
    df, _ = generate(SPEC)
    meta = meta_of(dp_size=4, world_size=8)
    with pytest.raises(TraceError, match=r"trace has 4 workers .* dp_size × pp_size = 4×2 = 8"):
        validate(df, meta, "t")


def test_rank_outside_world_is_named():
    df, _ = generate(SPEC)
    df.loc[0, "dp_rank"] = 5
    with pytest.raises(TraceError, match=r"dp_rank 5 \(row 0\) is outside 0..1"):
        validate(df, meta_of(), "t")


def test_non_numeric_value_is_named():
    df, _ = generate(SPEC)
    df["duration"] = df["duration"].astype(object)
    df.loc[4, "duration"] = "slow"
    with pytest.raises(TraceError, match=r"column 'duration' has .* 'slow' \(row 4\)"):
        validate(df, meta_of(), "t")


def test_step_without_optimizer_is_dropped_and_counted():
    df, _ = generate(SPEC)
    gone = (df["step"] == 5) & (df["dp_rank"] == 1) & (df["stage"] == 0)
    gone &= df["optype"] == "optimizer"
    assert gone.sum() == 1
    meta = meta_of()
    layout = build_layout(validate(df[~gone], meta), meta)
    assert layout.dropped_steps == [5]
    assert list(layout.step_ids) == [3, 9]
    assert layout.warnings == [
        "step 5: worker (dp_rank 1, stage 0) has no optimizer op; step dropped"
    ]


def test_step_with_a_missing_op_is_dropped():
    df, _ = generate(SPEC)
    gone = (df["step"] == 9) & (df["optype"] == "forward-compute") & (df["stage"] == 1)
    gone &= (df["seq_id"] == 2) & (df["dp_rank"] == 0)
    meta = meta_of()
    layout = build_layout(validate(df[~gone], meta), meta)
    assert layout.dropped_steps == [9]
    assert "step 9: worker (dp_rank 0, stage 1) has" in layout.warnings[0]


def test_no_complete_step_is_an_error():
    df, _ = generate(SPEC)
    keep = ~((df["optype"] == "optimizer") & (df["dp_rank"] == 0))
    meta = meta_of()
    with pytest.raises(TraceError, match="no complete step to analyse"):
        build_layout(validate(df[keep], meta), meta)


def test_duplicate_op_is_an_error():
    df, _ = generate(SPEC)
    meta = meta_of()
    with pytest.raises(TraceError, match=r"more than once"):
        build_layout(validate(df.iloc[np.r_[0 : len(df), 10]], meta), meta)


def test_meta_file_errors(tmp_path):
    bad = tmp_path / "m.yaml"
    bad.write_text("dp_size: 2\npp_size: two\nworld_size: 4\n")
    with pytest.raises(TraceError, match=r"m\.yaml: pp_size must be a positive integer"):
        read_meta(bad)
    bad.write_text("dp_size: 2\nworld_size: 4\n")
    with pytest.raises(TraceError, match=r"missing key 'pp_size'"):
        read_meta(bad)
    with pytest.raises(TraceError, match="cannot read metadata"):
        read_meta(tmp_path / "absent.yaml")


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(TraceError, match=r"unknown trace format '\.txt'"):
        load_trace(tmp_path / "t.txt", meta_of())
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "t.parquet", meta_of())


def test_parquet_and_csv_give_the_same_layout(trace_files, tmp_path):
    meta = meta_of()
    parquet, _ = trace_files(SPEC, ".parquet")
    csv, _ = trace_files(SPEC, ".csv")
    a = build_layout(load_trace(parquet, meta), meta)
    b = build_layout(load_trace(csv, meta), meta)
    np.testing.assert_allclose(a.duration_s, b.duration_s, rtol=1e-12)
    np.testing.assert_allclose(a.start_s, b.start_s, atol=1e-6)
    assert (a.node_op == b.node_op).all() and (a.node_mb == b.node_mb).all()


def test_layout_shape_follows_schedule(layout_of):
    layout = layout_of(SPEC)
    assert layout.start_s.shape == (layout.nodes, 3, 2)
    assert (layout.start_s >= 0).all() and np.isclose(layout.start_s.min(axis=(0, 2)), 0).all()


def test_real_trace_vocabulary_is_accepted():
    """gc rows, a category no row uses, float32 times, zero durations, sampled steps."""
    import pandas as pd

    df, _ = generate(SPEC)
    assert (df["optype"] == "gc").any()
    df["optype"] = df["optype"].cat.add_categories(["first-op"])
    df["start_ts"] = (df["start_ts"] - df["start_ts"].min()).astype("float32")
    df["duration"] = df["duration"].astype("float32")
    df.loc[df["optype"] == "gc", "duration"] = 0.0
    meta = meta_of()
    out = validate(df, meta, "t")
    assert len(out) == len(df)
    layout = build_layout(out, meta)
    assert list(layout.step_ids) == [3, 5, 9]
    assert isinstance(df["optype"].dtype, pd.CategoricalDtype)


def test_unknown_category_in_use_is_named_with_its_row():
    df, _ = generate(SPEC)
    df["optype"] = df["optype"].cat.add_categories(["first-op"])
    df.loc[11, "optype"] = "first-op"
    with pytest.raises(TraceError, match=r"^t: unknown optype 'first-op' \(row 11\); expected"):
        validate(df, meta_of(), "t")
