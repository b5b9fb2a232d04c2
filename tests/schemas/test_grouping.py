"""Partial summaries grouped and merged: the sketches keep their keys' wire type (32 bits)."""

from __future__ import annotations

import numpy as np

from trainscope.schemas.grouping import Partials, merge_partials, reduce_events
from trainscope.schemas.sketch import bucket_keys


def test_merged_partials_keep_32_bit_sketch_keys_and_their_counts() -> None:
    rng = np.random.default_rng(7)
    parts = []
    for _ in range(3):  # the same groups in three messages: merged into one row each
        group = rng.integers(0, 5, size=200).astype(np.int64)
        duration_ns = rng.lognormal(13, 1, size=200).astype(np.int64)
        parts.append((group, duration_ns, reduce_events(group, duration_ns, np.zeros(200))))
    merged = merge_partials(Partials.concat([p for _, _, p in parts]))

    assert all(p.sketch_key.dtype == np.int32 for _, _, p in parts)
    assert merged.sketch_key.dtype == np.int32
    assert merged.group.tolist() == sorted(set(merged.group.tolist()))
    group = np.concatenate([g for g, _, _ in parts])
    keys = bucket_keys(np.concatenate([d for _, d, _ in parts]))
    for row, g in enumerate(merged.group):
        mine = merged.sketch_row == row
        expected_keys, expected_counts = np.unique(keys[group == g], return_counts=True)
        assert merged.sketch_key[mine].tolist() == expected_keys.tolist()
        assert merged.sketch_count[mine].tolist() == expected_counts.tolist()
