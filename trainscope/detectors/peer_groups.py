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
# The most cells (suspects × members) the victims' search tests in one numpy pass.
_CELLS = 1 << 22
# A suspect's group members that wait long enough are sorted out of the group's slice by time
# when there are at most this many times the victims wanted, else found by a scan from the
# front: with more, they are dense enough for a scan to find them early (about
# limit · group / waiting members tested), and sorting them would cost more.
_FEW = 8


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
        self._kinds: list[_GroupKind] | None = None

    def healthy_wait(self) -> float:
        """The job's lower quartile of collective time (computed once)."""
        if self._healthy_wait is None:
            self._healthy_wait = float(self.waits.quantile(HEALTHY_QUANTILE))
        return self._healthy_wait

    def waiting_on(self, at: np.ndarray, threshold: np.ndarray, limit: int) -> np.ndarray:
        """For the rank at each position of ``at``: the positions, ascending, of the first
        ``limit`` ranks sharing a TP, DP or PP group with it (not itself) whose collective time
        reaches its ``threshold``; one row per rank, padded with ``len(self.ranks)``.

        All suspects at once: a window can hold thousands (3,920 in the last window of the
        10,240-rank benchmark, where a pass per suspect cost 0.2 s). The first ``limit`` of
        the union are among the first ``limit`` of each kind of group, so only those are
        merged."""
        if self._kinds is None:
            self._kinds = [_GroupKind(codes, self.wait_or_zero)
                           for codes in (self.tp_group, self.dp_group, self.pp_group)]
        padded = len(self.ranks)
        parts = [kind.first_waiting(at, threshold, limit) for kind in self._kinds]
        union = np.sort(np.concatenate(parts, axis=1), axis=1)
        repeat = np.zeros(union.shape, dtype=bool)
        repeat[:, 1:] = union[:, 1:] == union[:, :-1]  # a rank in two of the groups: once
        union[repeat] = padded
        union.sort(axis=1)
        return union[:, :limit]

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


class _GroupKind:
    """The window's ranks in one kind of communicator group (TP, DP or PP), sorted twice: by
    group and position, and by group and collective time, so that for each of thousands of
    suspects the members of its group that wait at least some threshold are found without a
    pass over the group: a DP group grows with the job as the suspects do (all 10,240 ranks,
    3,920 suspects, in the benchmark's last window), so a pass per suspect grew with the
    square of the job."""

    def __init__(self, codes: np.ndarray, waits: np.ndarray) -> None:
        n = len(codes)
        self.codes = codes
        self.padded = n
        # Group g's members are by_position[bounds[g]:bounds[g + 1]] (codes are 0, 1, …; a
        # rank outside the topology has a negative code of its own and no group).
        self.by_position = np.argsort(codes, kind="stable")
        groups = int(codes.max()) + 1 if n else 0
        self.bounds = np.searchsorted(codes[self.by_position], np.arange(max(groups, 0) + 1))
        self.wait_by_position = waits[self.by_position]
        # Ranks by group, then by collective time: key = group · (n + 1) + the rank's place
        # in the job's waits, ascending. Those of group g waiting at least t are one slice.
        by_wait = np.argsort(waits, kind="stable")
        self.sorted_waits = waits[by_wait]
        place = np.empty(n, dtype=np.int64)
        place[by_wait] = np.arange(n)
        key = codes.astype(np.int64) * (n + 1) + place
        self.by_group_wait = np.argsort(key, kind="stable")
        self.sorted_keys = key[self.by_group_wait]

    def first_waiting(self, at: np.ndarray, threshold: np.ndarray, limit: int) -> np.ndarray:
        """Per position of ``at``: the first ``limit`` members of its group (ascending
        positions), other than itself, whose collective time reaches its ``threshold``;
        padded with ``len(codes)``. Where few members wait that long (at most
        ``_FEW × limit``), they are taken from the slice of the group sorted by time;
        otherwise they are dense, and the group is scanned from the front in blocks."""
        found = np.full((len(at), limit), self.padded, dtype=np.int64)
        own = self.codes[at].astype(np.int64)
        grouped = own >= 0
        if not grouped.any():
            return found
        stride = self.padded + 1
        lowest = np.searchsorted(self.sorted_waits, threshold)  # places of waits >= threshold
        first = np.searchsorted(self.sorted_keys, own * stride + lowest)
        last = np.searchsorted(self.sorted_keys, (own + 1) * stride)
        waiting = np.where(grouped, last - first, 0)
        few = np.flatnonzero(grouped & (waiting <= _FEW * limit))
        if len(few):
            found[few] = self._fewest(at[few], first[few], last[few], limit)
        many = np.flatnonzero(waiting > _FEW * limit)
        if len(many):
            group = own[many]
            found[many] = self._scan(at[many], threshold[many], self.bounds[group],
                                     self.bounds[group + 1], limit)
        return found

    def _fewest(self, at: np.ndarray, first: np.ndarray, last: np.ndarray,
                limit: int) -> np.ndarray:
        """The lowest ``limit`` positions of ``by_group_wait[first:last]`` per row, not ``at``."""
        width = int((last - first).max())
        if width == 0:
            return np.full((len(at), limit), self.padded, dtype=np.int64)
        index = first[:, None] + np.arange(width)
        position = self.by_group_wait[np.minimum(index, self.padded - 1)]
        taken = (index < last[:, None]) & (position != at[:, None])
        ascending = np.sort(np.where(taken, position, self.padded), axis=1)[:, :limit]
        if ascending.shape[1] < limit:
            ascending = np.pad(ascending, ((0, 0), (0, limit - ascending.shape[1])),
                               constant_values=self.padded)
        return ascending

    def _scan(self, at: np.ndarray, threshold: np.ndarray, start: np.ndarray, end: np.ndarray,
              limit: int) -> np.ndarray:
        """The first ``limit`` members waiting ``threshold``, looked for from the front of each
        group in blocks that double: many members wait that long, so they come early."""
        found = np.full((len(at), limit), self.padded, dtype=np.int64)
        start = start.copy()
        count = np.zeros(len(at), dtype=np.int64)
        block = 2 * limit
        pending = np.flatnonzero(start < end)
        while len(pending):
            block = min(block, int((end[pending] - start[pending]).max()))
            # Suspects a slice at a time: a block of a large DP group for thousands of them
            # at once would be a matrix of a few hundred million cells.
            for rows in np.array_split(pending, -(-len(pending) * block // _CELLS)):
                index = start[rows, None] + np.arange(block)
                inside = index < end[rows, None]
                index = np.minimum(index, self.padded - 1)
                position = self.by_position[index]
                hit = (inside & (self.wait_by_position[index] >= threshold[rows, None])
                       & (position != at[rows, None]))
                slot = np.cumsum(hit, axis=1) - 1 + count[rows, None]
                keep = hit & (slot < limit)
                found[np.broadcast_to(rows[:, None], keep.shape)[keep], slot[keep]] = \
                    position[keep]
                count[rows] += hit.sum(axis=1)
            start[pending] += block
            block *= 2
            pending = pending[(count[pending] < limit) & (start[pending] < end[pending])]
        return found


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
    return victims_many(groups, [(culprits, excess, culprit_waits_too)])[0]


def victims_many(
    groups: Groups, suspects: list[tuple[list[int], float, bool]]
) -> list[list[int]]:
    """:func:`victims` of each (culprits, excess, culprit_waits_too); those of one culprit,
    nearly all, at once."""
    found: list[list[int]] = [[] for _ in suspects]
    if groups.waits.empty:
        return found
    single = [i for i, (culprits, _, _) in enumerate(suspects)
              if len(culprits) == 1 and culprits[0] in groups.position]
    if single:
        at = np.array([groups.position[suspects[i][0][0]] for i in single], dtype=np.int64)
        # Everyone in a synchronous job waits for a straggler, so the healthy reference is the
        # culprit's own wait: it arrives last and waits least. A slow link is the exception:
        # the culprit sits in the slow collective too, so compare with the job's lower
        # quartile.
        own_wait = groups.wait_at[at]
        by_own = ~np.isnan(own_wait) & ~np.array([suspects[i][2] for i in single])
        baseline = own_wait if by_own.all() else np.where(by_own, own_wait,
                                                          groups.healthy_wait())
        threshold = baseline + VICTIM_WAIT_FRAC * np.array([suspects[i][1] for i in single])
        positions = groups.waiting_on(at, threshold, MAX_VICTIMS)
        counts = (positions < len(groups.ranks)).sum(axis=1).tolist()
        ranks = np.append(groups.ranks.astype(np.int64), -1)  # the padding
        for i, row, count in zip(single, ranks[positions].tolist(), counts, strict=True):
            found[i] = row[:count]
    for i, (culprits, excess, culprit_waits_too) in enumerate(suspects):
        if len(culprits) != 1 or culprits[0] not in groups.position:
            found[i] = _victims_of_several(groups, culprits, excess, culprit_waits_too)
    return found


def _victims_of_several(groups: Groups, culprits: list[int], excess: float,
                        culprit_waits_too: bool) -> list[int]:
    """A stage's ranks (or a culprit outside the layout): a pass over the layout, as there
    are few such findings a window."""
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
