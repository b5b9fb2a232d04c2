"""A mergeable quantile sketch: a sparse histogram over logarithmic buckets.

The bucket of a duration ``x`` (ns) is ``ceil(log(x) / log(gamma))`` with
``gamma = (1 + a) / (1 - a)`` — the same mapping as DDSketch, so every quantile it reports is
within relative error ``a`` (1%) of a true sample value. We do not use the ``ddsketch`` package
itself: it adds values one at a time in Python (about a microsecond each), while the window engine
must bucket millions of durations per second; here bucketing is one vectorised numpy expression
and merging two sketches is adding counts of equal keys, exactly and in any order.
"""

from __future__ import annotations

import math

import numpy as np

RELATIVE_ACCURACY = 0.01
GAMMA = (1 + RELATIVE_ACCURACY) / (1 - RELATIVE_ACCURACY)
_INV_LOG_GAMMA = 1.0 / math.log(GAMMA)


def bucket_keys(values_ns: np.ndarray) -> np.ndarray:
    """Bucket key per value; values below 1 ns share key 0."""
    values = np.maximum(np.asarray(values_ns, dtype=np.float64), 1.0)
    return np.ceil(np.log(values) * _INV_LOG_GAMMA).astype(np.int32)


def bucket_value(keys: np.ndarray | int) -> np.ndarray | float:
    """The value a bucket stands for: the point of least relative error within it."""
    return 2.0 * np.power(GAMMA, np.asarray(keys, dtype=np.float64)) / (GAMMA + 1.0)


def sketch_of(values_ns: np.ndarray) -> tuple[list[int], list[int]]:
    keys, counts = np.unique(bucket_keys(values_ns), return_counts=True)
    return keys.tolist(), counts.tolist()


def merge(
    keys_a: list[int], counts_a: list[int], keys_b: list[int], counts_b: list[int]
) -> tuple[list[int], list[int]]:
    merged: dict[int, int] = dict(zip(keys_a, counts_a, strict=True))
    for key, count in zip(keys_b, counts_b, strict=True):
        merged[key] = merged.get(key, 0) + count
    keys = sorted(merged)
    return keys, [merged[k] for k in keys]


def quantile(keys: list[int], counts: list[int], q: float) -> float:
    """The q-quantile (0 <= q <= 1) in ns; NaN for an empty sketch."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    total = sum(counts)
    if total == 0:
        return math.nan
    order = np.argsort(keys)
    sorted_keys = np.asarray(keys)[order]
    cumulative = np.cumsum(np.asarray(counts)[order])
    rank = q * (total - 1)
    index = int(np.searchsorted(cumulative, rank, side="right"))
    return float(bucket_value(int(sorted_keys[min(index, len(sorted_keys) - 1)])))
