"""river's Half-Space Trees, scored and taught many rows at once.

river scores and learns one row at a time (``Pipeline.score_one``/``learn_one``: a dict through
the scaler, then a Python walk down each of the trees). At 10,240 ranks that was most of the
``multivariate`` detector's time (about 0.3 s per window to score; learning 1,024 rows took
about 20 ms more, plus the rows' dicts). The model stays river's, and its state is
checkpointed as before; only the walks are done here, on the same state and with the same
arithmetic:

- scoring: the scaler's ``(x - min) / (max - min)``, each tree's walk summing
  ``r_mass * 2**depth`` (integers, exact in float64) and stopping below the size limit, a
  missing feature taking the child visited most;
- learning: the scaler's running min and max (row by row, as ``np.minimum.accumulate``), each
  row scaled by the limits that include it, each tree's ``l_mass`` counted along every row's
  path, and the masses pivoted after every ``window_size`` rows, where river pivots them; a
  feature a tree splits on that the frame lacks sends a row to the child learned most, which
  is the same child for every row until the next pivot.

So the scores and the learned state are river's, bit for bit
(``tests/detectors/test_multivariate.py`` compares them).
"""

from __future__ import annotations

import weakref
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
    size_limit = 0.1 * hst.window_size
    total = np.zeros(n)
    for tree in _forest(hst, columns):
        total += tree.scores(scaled, hst.height, size_limit)
    return 1 - total / hst._max_score


def learn_many(model: Any, frame: pd.DataFrame) -> None:
    """``model.learn_one(row)`` for every row of ``frame``, in order, where ``model`` is river's
    ``Pipeline(MinMaxScaler(), HalfSpaceTrees(...))``: the same state afterwards."""
    scaler, hst = model.steps.values()
    if len(frame) and not hst.trees:
        # river builds the trees at the first row (its features, its random draws).
        model.learn_one(frame.iloc[:1].to_dict(orient="records")[0])
        frame = frame.iloc[1:]
    if not len(frame):
        return
    columns = list(frame.columns)
    values = frame.to_numpy(dtype=np.float64)
    trees = _forest(hst, columns)
    if getattr(scaler, "window_size", None) is not None or not np.isfinite(values).all():
        # A rolling scaler or a value that is not a number: row by row.
        for row in frame.to_dict(orient="records"):
            model.learn_one(row)
        return
    scaled = np.empty_like(values)
    for j, name in enumerate(columns):
        lo = np.minimum.accumulate(np.concatenate(([scaler.min[name].get()], values[:, j])))[1:]
        hi = np.maximum.accumulate(np.concatenate(([scaler.max[name].get()], values[:, j])))[1:]
        d = hi - lo
        with np.errstate(invalid="ignore", divide="ignore"):
            scaled[:, j] = np.where(d != 0, (values[:, j] - lo) / d, 0.0)
        scaler.min[name].update(float(lo[-1]))
        scaler.max[name].update(float(hi[-1]))
    # A tree that splits on a feature the frame lacks sends every row reaching such a node to
    # the child learned more so far (river's walk): that child's mass only grows, so all the
    # rows go the same way until the next pivot, the way the masses at its start say.
    paths = [None if tree.unknown else tree.paths(scaled, hst.height) for tree in trees]
    l_mass = [np.array([node.l_mass for node in t.nodes], dtype=np.int64) for t in trees]
    r_mass = [np.array([node.r_mass for node in t.nodes], dtype=np.int64) for t in trees]
    start, n = 0, len(frame)
    while start < n:
        stop = min(n, start + hst.window_size - hst.counter)
        for t, path in enumerate(paths):
            if path is None:
                tree = trees[t]
                part = tree.paths(scaled[start:stop], hst.height,
                                  l_mass[t][tree.left] < l_mass[t][tree.right])
            else:
                part = path[:, start:stop]
            l_mass[t] += np.bincount(part.ravel(), minlength=len(l_mass[t]))
        hst.counter += stop - start
        if hst.counter == hst.window_size:
            for t in range(len(trees)):
                r_mass[t], l_mass[t] = l_mass[t], np.zeros_like(l_mass[t])
            hst._first_window = False
            hst.counter = 0
        start = stop
    for tree, lefts, rights in zip(trees, l_mass, r_mass, strict=True):
        for node, left, right in zip(tree.nodes, lefts.tolist(), rights.tolist(), strict=True):
            node.l_mass, node.r_mass = left, right


class _TreeArrays:
    """One tree's structure as arrays, for the features in ``columns``: each node's split
    column (-1 at a leaf, or where the feature is not a column) and threshold, its children's
    indices. A tree's structure is fixed once river builds it; only its masses change."""

    def __init__(self, nodes: list[Any], columns: list[str]) -> None:
        position = {name: j for j, name in enumerate(columns)}
        index = {id(node): i for i, node in enumerate(nodes)}
        self.nodes = nodes
        self.left = np.zeros(len(nodes), dtype=np.int64)
        self.right = np.zeros(len(nodes), dtype=np.int64)
        self.column = np.full(len(nodes), -1, dtype=np.int64)
        self.threshold = np.zeros(len(nodes))
        self.branches: list[tuple[Any, Any]] = []  # (index, children) of every split
        self.unknown = False  # a split on a feature that is not a column
        for i, node in enumerate(nodes):
            children = getattr(node, "children", None)
            if not children:
                continue
            self.branches.append((i, children))
            self.left[i], self.right[i] = index[id(children[0])], index[id(children[1])]
            self.column[i] = position.get(node.feature, -1)
            self.unknown |= self.column[i] < 0
            self.threshold[i] = node.threshold

    def paths(self, scaled: np.ndarray, height: int,
              missing_goes_right: np.ndarray | None = None) -> np.ndarray:
        """Each row's nodes from the root to its leaf (``height + 1`` × rows): river's
        ``_walk_learn``. Where the tree splits on a feature that is not a column, a row goes
        right at the nodes ``missing_goes_right`` says."""
        rows = np.arange(scaled.shape[0])
        out = np.zeros((height + 1, scaled.shape[0]), dtype=np.int64)
        at = out[0]
        for level in range(1, height + 1):
            column = self.column[at]
            if missing_goes_right is None:
                go_right = ~(scaled[rows, column] < self.threshold[at])
            else:
                known = column >= 0
                value = scaled[rows, np.where(known, column, 0)]
                go_right = np.where(known, ~(value < self.threshold[at]),
                                    missing_goes_right[at])
            at = out[level] = np.where(go_right, self.right[at], self.left[at])
        return out

    def scores(self, scaled: np.ndarray, height: int, size_limit: float) -> np.ndarray:
        """river's ``_walk_score`` for every row, all rows a level at a time."""
        r_mass = np.array([node.r_mass for node in self.nodes], dtype=np.int64)
        missing_goes_right = np.zeros(len(self.nodes), dtype=bool)
        if self.unknown:
            for i, children in self.branches:
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
            col = self.column[at]
            known = col >= 0
            value = scaled[rows, np.where(known, col, 0)]
            # NaN compares False, as in Python: such a value goes right, as river's walk does.
            go_right = np.where(known, ~(value < self.threshold[at]), missing_goes_right[at])
            at = np.where(go_right, self.right[at], self.left[at])
            depth_pow <<= 1
        score += np.where(walking, r_mass[at] * depth_pow, 0)
        return score.astype(np.float64)


# Each model's trees as arrays, for the columns of its last frame: built once per model and
# set of features (about 10 ms at 25 trees of height 8), not twice per window. Weak keys: an
# entry goes with its model (a restored checkpoint is a new model); the arrays refer to the
# trees' nodes, never to the model.
_FORESTS: weakref.WeakKeyDictionary[Any, tuple[list[str], list[Any], list[_TreeArrays]]] = (
    weakref.WeakKeyDictionary())


def _forest(hst: Any, columns: list[str]) -> list[_TreeArrays]:
    cached = _FORESTS.get(hst)
    if cached is not None and cached[0] == columns and len(cached[1]) == len(hst.trees) and all(
            a is b for a, b in zip(cached[1], hst.trees, strict=True)):
        return cached[2]
    nodes = getattr(hst, "_tree_nodes", None)
    if not nodes or len(nodes) != len(hst.trees):  # a model from before river kept them
        nodes = [list(tree.iter_dfs()) for tree in hst.trees]
    forest = [_TreeArrays(tree_nodes, columns) for tree_nodes in nodes]
    _FORESTS[hst] = (list(columns), list(hst.trees), forest)
    return forest
