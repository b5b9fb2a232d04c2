"""The window engine's group key: (window, rank, function) packed into one int64, and the job's
function ids it holds.

Packing the three into one integer lets a window's rows be grouped, merged and split by window
with numpy sorts and comparisons on a single column (:mod:`trainscope.schemas.grouping`).
From the top: the window index relative to the job's base (23 bits), the rank (20 bits), the
job-wide function id (20 bits). A function is a (layer, name, call path); its id is the order in
which the job's records first named it, so ids never decide the order of a window's rows
(:meth:`FunctionTable.order` does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trainscope.schemas.records import SummaryBatch

FN_BITS = 20
RANK_BITS = 20
WINDOW_SHIFT = FN_BITS + RANK_BITS
MAX_RANK = (1 << RANK_BITS) - 1
_FN_MASK = (1 << FN_BITS) - 1
# Window indices are stored relative to a per-job base so they fit the 23 bits left; an event
# further than that from the job's first window is rejected rather than wrapped into another key.
WINDOW_MARGIN = 1 << 10
MAX_REL_WINDOW = (1 << (63 - WINDOW_SHIFT)) - 1
# Bound on the function dictionaries remembered per job (cleared when full).
_MAX_DICTIONARIES = 4096


def pack(rel_window: np.ndarray, rank: np.ndarray, fid: np.ndarray) -> np.ndarray:
    """Group keys of rows in window ``rel_window`` (relative to the job's base)."""
    return (rel_window << WINDOW_SHIFT) | (rank << FN_BITS) | fid


def window_of(group: np.ndarray) -> np.ndarray:
    """The relative window index of each key."""
    return group >> WINDOW_SHIFT


def rank_of(group: np.ndarray) -> np.ndarray:
    return (group >> FN_BITS) & MAX_RANK


def function_of(group: np.ndarray) -> np.ndarray:
    return group & _FN_MASK


@dataclass
class FunctionTable:
    """A job's functions by id: the id of each (layer, name, call path) and back."""

    ids: dict[tuple[str, str, int], int] = field(default_factory=dict)
    layer: list[str] = field(default_factory=list)
    name: list[str] = field(default_factory=list)
    callpath: list[int] = field(default_factory=list)
    _order: np.ndarray = field(
        init=False, repr=False, default_factory=lambda: np.zeros(0, dtype=np.int64)
    )
    # Function ids of the summary batches' function dictionaries seen lately.
    dictionaries: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]], np.ndarray] = (
        field(default_factory=dict)
    )

    def fid(self, layer: str, name: str, callpath: int) -> int:
        key = (layer, name, callpath)
        fid = self.ids.get(key)
        if fid is None:
            fid = self.ids[key] = len(self.layer)
            if fid >= 1 << FN_BITS:
                raise ValueError(f"more than {1 << FN_BITS} distinct functions in one job")
            self.layer.append(layer)
            self.name.append(name)
            self.callpath.append(callpath)
        return fid

    def of_batch(self, batch: SummaryBatch) -> np.ndarray:
        """Job-wide function id of each of the batch's functions."""
        # Each rank sends the same function dictionary window after window (and ranks of one
        # job mostly the same one): one lookup per dictionary instead of one per function.
        key = (tuple(batch.layers), tuple(batch.names), tuple(batch.callpaths))
        fids = self.dictionaries.get(key)
        if fids is None:
            if len(self.dictionaries) >= _MAX_DICTIONARIES:
                self.dictionaries.clear()
            fids = self.dictionaries[key] = np.array(
                [self.fid(layer, name, path) for layer, name, path in zip(*key, strict=True)],
                dtype=np.int64,
            )
        return fids

    def order(self) -> np.ndarray:
        """Each function id's position in (layer, name, call path) order."""
        n = len(self.layer)
        if len(self._order) != n:  # functions were added since the last window
            keys = sorted(range(n), key=lambda i: (self.layer[i], self.name[i], self.callpath[i]))
            self._order = np.empty(n, dtype=np.int64)
            self._order[keys] = np.arange(n)
        return self._order
