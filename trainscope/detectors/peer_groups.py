"""Peer-diff's per-window lookups over communicator groups: a suspect's victims, its pipeline
neighbours, and the larger suspects elsewhere.

A 10,240-rank window can hold thousands of suspects (``benchmarks/README.md``), so each of these
is built once per window and answers per suspect by array lookups, never by a pass over the
layout per suspect. ``tests/detectors/test_peer_scaling.py`` checks each against that pass.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainscope.detectors.features import group_codes

# At most this many victims are listed per finding (a finding is one row in the store).
MAX_VICTIMS = 64
# The healthy collective wait that network suspects and victims are measured from: the lower
# quartile of the job's, below the waits of a straggler's victims.
HEALTHY_QUANTILE = 0.25
# A rank related to a culprit is its victim when its wait grew by at least this share of the
# culprit's excess: it spends a material part of the delay waiting.
VICTIM_WAIT_FRAC = 0.25


class Groups:
    """The window's ranks by communicator group (TP: stage and DP rank; DP: stage and TP rank;
    PP: DP and TP rank) as integer codes, with each rank's collective time, so that the
    victims and pipeline neighbours of thousands of suspects in a 10,000-rank window are array
    lookups rather than a pass over the layout per suspect."""

    def __init__(self, layout: pd.DataFrame, waits: pd.Series) -> None:
        self.ranks = layout.index.to_numpy()
        self.position = {int(r): i for i, r in enumerate(self.ranks)}
        # A rank outside the declared topology has no coordinates (NaN): it shares no group.
        self.stage = layout["pp_stage"].to_numpy(dtype=float)
        self.tp_group, self.dp_group, self.pp_group = (
            group_codes(layout, keys).to_numpy()
            for keys in (["pp_stage", "dp_rank"], ["pp_stage", "tp_rank"],
                         ["dp_rank", "tp_rank"]))
        self.waits = waits
        # Each rank's collective time, by position; NaN for a rank that has none.
        self.wait_at = waits.reindex(layout.index).to_numpy(dtype=float)
        # ... and 0 for it, as a victim's wait is compared (once, not per suspect).
        self.wait_or_zero = np.nan_to_num(self.wait_at)
        self._healthy_wait: float | None = None
        self._by_pipeline: dict[tuple[int, int], int] | None = None
        self._members: list[tuple[np.ndarray, list[int]]] | None = None

    def healthy_wait(self) -> float:
        """The job's lower quartile of collective time (computed once)."""
        if self._healthy_wait is None:
            self._healthy_wait = float(self.waits.quantile(HEALTHY_QUANTILE))
        return self._healthy_wait

    def waiting_on(self, at: int, threshold: float, limit: int) -> np.ndarray:
        """Positions, ascending, of the first ``limit`` ranks sharing a TP, DP or PP group with
        the rank at position ``at`` (not itself) whose collective time reaches ``threshold``.
        Each group's members are a slice of the groups sorted once; the first ``limit`` of the
        union are among the first ``limit`` of each group, so only those are merged: a mask
        over every rank per suspect would cost three passes over the job, a sort of all the
        members a few hundred positions per suspect, thousands of times a window."""
        if self._members is None:
            self._members = []
            for codes in (self.tp_group, self.dp_group, self.pp_group):
                order = np.argsort(codes, kind="stable")  # ascending positions within a group
                # Group g's members are order[bounds[g]:bounds[g + 1]] (codes are 0, 1, …;
                # a rank outside the topology has a negative code of its own).
                groups = int(codes.max()) + 1 if len(codes) else 0
                bounds = np.searchsorted(codes[order], np.arange(max(groups, 0) + 1))
                self._members.append((order, bounds.tolist()))
        parts = []
        for (order, bounds), own in zip(self._members, (self.tp_group[at], self.dp_group[at],
                                                        self.pp_group[at]), strict=True):
            if own < 0:
                continue  # shares this group with no one
            parts.append(self._first_waiting(order[bounds[own]:bounds[own + 1]], at,
                                             threshold, limit))
        if not parts:
            return np.zeros(0, dtype=np.int64)
        ascending = np.sort(np.concatenate(parts))
        keep = np.ones(len(ascending), dtype=bool)
        keep[1:] = ascending[1:] != ascending[:-1]  # a rank in two of the groups: once
        return ascending[keep][:limit]

    def _first_waiting(self, members: np.ndarray, at: int, threshold: float, limit: int
                       ) -> np.ndarray:
        """The first ``limit`` of ``members`` (ascending positions) other than ``at`` whose
        collective time reaches ``threshold``. Looked for in blocks that double, from twice
        ``limit``: a DP group grows with the job (1,920 ranks at 30,720) as do the suspects, so
        testing every member for every suspect grew with the square of the job, while the
        first ``limit`` are usually near the front (a straggler's peers all wait)."""
        found: list[np.ndarray] = []
        count, start, block = 0, 0, 2 * limit
        while start < len(members) and count < limit:
            part = members[start:start + block]
            hit = part[(part != at) & (self.wait_or_zero[part] >= threshold)]
            found.append(hit)
            count += len(hit)
            start += block
            block *= 2
        return np.concatenate(found)[:limit] if found else members[:0]

    def pipeline_neighbours(self, rank: int) -> list[int]:
        """The ranks one pipeline link away from ``rank`` (the stages before and after it)."""
        i = self.position.get(rank)
        if i is None or np.isnan(self.stage[i]):
            return []
        if self._by_pipeline is None:
            self._by_pipeline = {(int(g), int(st)): int(r) for g, st, r
                                 in zip(self.pp_group, self.stage, self.ranks, strict=True)
                                 if not np.isnan(st)}
        key = int(self.pp_group[i])
        return [r for st in (self.stage[i] - 1, self.stage[i] + 1)
                if (r := self._by_pipeline.get((key, int(st)))) is not None]


class LargerElsewhere:
    """For each suspect, the summed excess of the larger suspects on other ranks, leaving out
    the other end of a slow link (a network suspect on a pipeline neighbour): a sort and a
    running sum, not a pass over every suspect per suspect."""

    def __init__(self, totals: dict[tuple[int, str], float], groups: Groups) -> None:
        self._totals = totals
        self._groups = groups
        self._ascending = np.sort(np.fromiter(totals.values(), dtype=float, count=len(totals)))
        self._running = np.concatenate([[0.0], np.cumsum(self._ascending)])
        self._by_rank: dict[int, list[float]] = {}
        for (rank, _), excess in totals.items():
            self._by_rank.setdefault(rank, []).append(excess)

    def than(self, rank: int, category: str, excess: float) -> float:
        above = int(np.searchsorted(self._ascending, excess, side="right"))
        larger = float(self._running[-1] - self._running[above])
        larger -= sum(e for e in self._by_rank[rank] if e > excess)
        if category == "network":
            for neighbour in self._groups.pipeline_neighbours(rank):
                e = self._totals.get((neighbour, "network"), 0.0)
                if e > excess:
                    larger -= e
        return max(larger, 0.0)

    def smaller_here(self, rank: int, excess: float) -> float:
        """The summed excess of the other suspects on ``rank`` smaller than ``excess``."""
        here = self._by_rank[rank]
        return sum(e for e in here if e < excess) if len(here) > 1 else 0.0


def victims(
    groups: Groups,
    culprits: list[int],
    excess: float,
    culprit_waits_too: bool = False,
) -> list[int]:
    """Ranks sharing a TP, DP or PP group with a culprit whose collective time is inflated."""
    if groups.waits.empty:
        return []
    # Everyone in a synchronous job waits for a straggler, so the healthy reference is the
    # culprit's own wait: it arrives last and waits least. A slow link is the exception: the
    # culprit sits in the slow collective too, so compare with the job's lower quartile.
    if len(culprits) == 1 and culprits[0] in groups.position:  # the usual case, scalar
        one = groups.position[culprits[0]]
        own_wait = float(groups.wait_at[one])
        known = not np.isnan(own_wait)
        baseline = own_wait if known and not culprit_waits_too else groups.healthy_wait()
        threshold = baseline + VICTIM_WAIT_FRAC * excess
        return [int(r) for r in groups.ranks[groups.waiting_on(one, threshold, MAX_VICTIMS)]]
    at = np.array([groups.position[r] for r in culprits if r in groups.position], dtype=np.int64)
    own = groups.wait_at[at]
    own = own[~np.isnan(own)]
    baseline = float(own.min()) if len(own) and not culprit_waits_too else groups.healthy_wait()
    threshold = baseline + VICTIM_WAIT_FRAC * excess
    related = (np.isin(groups.tp_group, groups.tp_group[at])
               | np.isin(groups.dp_group, groups.dp_group[at])
               | np.isin(groups.pp_group, groups.pp_group[at]))
    related[at] = False
    inflated = groups.wait_or_zero >= threshold
    return [int(r) for r in groups.ranks[related & inflated][:MAX_VICTIMS]]
