"""The log-bucket sketch and summary merging."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscope.schemas import sketch, summaries


@given(st.lists(st.integers(1, 10**10), min_size=1, max_size=300), st.floats(0, 1))
@settings(max_examples=200, deadline=None)
def test_quantiles_are_within_relative_accuracy_of_a_sample(values: list[int], q: float) -> None:
    keys, counts = sketch.sketch_of(np.array(values))
    got = sketch.quantile(keys, counts, q)
    ordered = np.sort(values)
    true = ordered[int(np.floor(q * (len(values) - 1)))]
    assert abs(got - true) <= sketch.RELATIVE_ACCURACY * true * 1.0001


@given(
    st.lists(st.integers(1, 10**9), min_size=1, max_size=100),
    st.lists(st.integers(1, 10**9), min_size=1, max_size=100),
)
@settings(max_examples=100, deadline=None)
def test_merge_equals_summary_of_the_union(a: list[int], b: list[int]) -> None:
    common = {"job_id": "j", "rank": 0, "layer": "l", "name": "n"}
    sa = summaries.summarize(a, window_start_ns=0, window_end_ns=1, **common)
    sb = summaries.summarize(b, window_start_ns=1, window_end_ns=2, **common)
    both = summaries.summarize(a + b, window_start_ns=0, window_end_ns=2, **common)
    merged = summaries.merge(sa, sb)
    assert (merged.count, merged.total_ns, merged.min_ns, merged.max_ns) == (
        both.count, both.total_ns, both.min_ns, both.max_ns)
    assert merged.m2_ns2 == pytest.approx(both.m2_ns2, rel=1e-9, abs=1e-3)
    assert (merged.sketch_keys, merged.sketch_counts) == (both.sketch_keys, both.sketch_counts)


def test_merge_refuses_different_functions() -> None:
    a = summaries.summarize([1], job_id="j", rank=0, layer="l", name="a", window_start_ns=0,
                            window_end_ns=1)
    b = summaries.summarize([1], job_id="j", rank=0, layer="l", name="b", window_start_ns=0,
                            window_end_ns=1)
    with pytest.raises(ValueError, match="different functions"):
        summaries.merge(a, b)
