"""The answer does not depend on the order of rows, nor on the order of simultaneous ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainscope.schemas.optrace import JobMeta, read_meta, read_table, validate
from trainscope.whatif.analysis import analyse
from trainscope.whatif.generate import JobSpec, generate
from trainscope.whatif.layout import build_layout

DATA = Path(__file__).resolve().parent.parent / "data" / "stragglers-ST"


def real_trace() -> tuple[pd.DataFrame, JobMeta]:
    return read_table(DATA / "trace-ST.parquet"), read_meta(DATA / "meta-ST.yaml")


def generated_trace() -> tuple[pd.DataFrame, JobMeta]:
    df, meta = generate(
        JobSpec(dp_size=2, pp_size=4, steps=[1, 4, 9], worker_factor={(1, 2): 1.3}, seed=21)
    )
    return df, JobMeta.from_mapping(meta)


def figures(df: pd.DataFrame, meta: JobMeta) -> np.ndarray:
    r = analyse(build_layout(validate(df, meta), meta))
    return np.array([r.S, r.M_W, r.M_S])


TRACES = {"real": real_trace(), "generated": generated_trace()}
BASELINE = {name: figures(*trace) for name, trace in TRACES.items()}


def test_the_traces_have_simultaneous_ops():
    for df, _ in TRACES.values():
        keys = ["step", "dp_rank", "stage", "start_ts"]
        assert df.duplicated(keys).any()


@pytest.mark.parametrize("name", sorted(TRACES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_shuffled_rows_give_the_same_figures(name, seed):
    df, meta = TRACES[name]
    shuffled = df.sample(frac=1.0, random_state=np.random.RandomState(seed))
    np.testing.assert_allclose(figures(shuffled, meta), BASELINE[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(TRACES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_simultaneous_ops_in_any_order_give_the_same_figures(name, seed):
    """Rows stay in time order; only ops that start at the same time swap places."""
    df, meta = TRACES[name]
    ordered = df.sort_values(["step", "dp_rank", "stage", "start_ts"], kind="stable")
    tie_break = np.random.default_rng(seed).random(len(ordered))
    swapped = ordered.assign(_r=tie_break).sort_values(
        ["step", "dp_rank", "stage", "start_ts", "_r"]
    )
    np.testing.assert_allclose(
        figures(swapped.drop(columns="_r"), meta), BASELINE[name], rtol=0, atol=1e-6
    )
