"""The per-step table several detectors share is the pivot table of the window's summaries, to
the bit: it is computed from codes and a bincount because the pivot cost a tenth of a second a
window at 10,240 ranks (benchmarks/README.md)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from trainscope.detectors.features import _summed_times


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("strings", ["object", "string"])
def test_summed_times_are_the_pivot_table(seed: int, strings: str) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 400))
    layers = rng.choice(["torch_op", "collective", "gc", "cuda_kernel"], rows)
    names = rng.choice(["backward", "forward", "all_reduce", "zz", "Ä"], rows)
    frame = pd.DataFrame({
        "rank": rng.integers(0, 30, rows),  # some ranks without some functions: 0 there
        "layer": pd.array(layers, dtype=strings),
        "name": pd.array(names, dtype=strings),
        "total_ns": rng.integers(0, 10**10, rows),  # several rows of one key: call paths
    })
    if seed % 2:
        frame.loc[frame.index[:3], "name"] = None  # rows without a key are not counted
    expected = frame.pivot_table(index="rank", columns=["layer", "name"], values="total_ns",
                                 aggfunc="sum", fill_value=0)
    got = _summed_times(frame)
    assert got is not None
    pd.testing.assert_frame_equal(got, expected.astype(float), check_exact=True)
    assert got.columns.equals(expected.columns)
    # Laid out as the pivot's frame: a sum across a rank's functions (the mixture's shares)
    # adds in the same order, so it is the same to the last bit too.
    steps = pd.Series(rng.integers(1, 12, len(got)).astype(float), index=got.index)
    np.testing.assert_array_equal(got.div(steps, axis=0).sum(axis=1).to_numpy(),
                                  expected.div(steps, axis=0).sum(axis=1).to_numpy())


def test_sums_beyond_exact_float_integers_are_left_to_the_pivot() -> None:
    frame = pd.DataFrame({"rank": [0, 0], "layer": ["a", "a"], "name": ["f", "f"],
                          "total_ns": [2**62, 2**62 - 1]})
    assert _summed_times(frame) is None
