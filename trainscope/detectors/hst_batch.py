"""river's Half-Space Trees, scored for many rows at once.

river scores one row at a time (``Pipeline.score_one``: a dict through the scaler, then a
Python walk down each tree). At 10,240 ranks that is most of the ``multivariate`` detector's
time (about 0.3 s per window). The model stays river's — it learns with ``learn_one`` as before
and its state is checkpointed as before — only the scoring is done here, on the same state and
with the same arithmetic: the scaler's ``(x - min) / (max - min)``, each tree's walk summing
``r_mass * 2**depth`` (integers, exact in float64) and stopping below the size limit, a missing
feature taking the child visited most. So the scores are river's, bit for bit
(``tests/detectors/test_multivariate.py`` compares them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def score_many(model: Any, frame: pd.DataFrame) -> np.ndarray:
    """``model.score_one(row)`` for every row of ``frame``, where ``model`` is river's
    ``Pipeline(MinMaxScaler(), HalfSpaceTrees(...))``."""
    scaler, hst = model.steps.values()
    n = len(frame)
    if hst._first_window:
        return np.zeros(n)
    columns = list(frame.columns)
    values = frame.to_numpy(dtype=np.float64)
    scaled = np.empty_like(values)
    for j, name in enumerate(columns):
        lo, hi = scaler.min[name].get(), scaler.max[name].get()
        d = hi - lo
        # A feature the scaler never saw has infinite limits: NaN, quietly, as in Python.
        with np.errstate(invalid="ignore", divide="ignore"):
            scaled[:, j] = (values[:, j] - lo) / d if d else 0.0
    position = {name: j for j, name in enumerate(columns)}
    size_limit = 0.1 * hst.window_size
    total = np.zeros(n)
    for tree in hst.trees:
        total += _walk_scores(tree, scaled, position, hst.height, size_limit)
    return 1 - total / hst._max_score


def _walk_scores(root: Any, scaled: np.ndarray, position: dict[str, int], height: int,
                 size_limit: float) -> np.ndarray:
    """river's ``_walk_score`` for every row: the nodes as arrays, all rows a level at a time."""
    nodes = list(root.iter_dfs())
    index = {id(node): i for i, node in enumerate(nodes)}
    r_mass = np.array([node.r_mass for node in nodes], dtype=np.int64)
    left = np.zeros(len(nodes), dtype=np.int64)
    right = np.zeros(len(nodes), dtype=np.int64)
    column = np.full(len(nodes), -1, dtype=np.int64)
    threshold = np.zeros(len(nodes))
    missing_goes_right = np.zeros(len(nodes), dtype=bool)
    for i, node in enumerate(nodes):
        children = getattr(node, "children", None)
        if not children:
            continue
        left[i], right[i] = index[id(children[0])], index[id(children[1])]
        column[i] = position.get(node.feature, -1)
        threshold[i] = node.threshold
        missing_goes_right[i] = children[0].l_mass < children[1].l_mass
    rows = np.arange(scaled.shape[0])
    at = np.zeros(scaled.shape[0], dtype=np.int64)
    walking = np.ones(scaled.shape[0], dtype=bool)
    score = np.zeros(scaled.shape[0], dtype=np.int64)
    depth_pow = 1
    for _ in range(height):
        r = r_mass[at]
        score += np.where(walking, r * depth_pow, 0)
        walking &= r >= size_limit
        col = column[at]
        known = col >= 0
        value = scaled[rows, np.where(known, col, 0)]
        # NaN compares False, as in Python: such a value goes right, as river's walk does.
        go_right = np.where(known, ~(value < threshold[at]), missing_goes_right[at])
        at = np.where(go_right, right[at], left[at])
        depth_pow <<= 1
    score += np.where(walking, r_mass[at] * depth_pow, 0)
    return score.astype(np.float64)
