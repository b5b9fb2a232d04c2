"""Each rank's clock against its peers': estimated from the step records, corrected before
windowing.

Event times are read off each rank's own host clock, and one wrong clock (NTP drift, a host set
wrong) must not decide the job's windows. In synchronous training the collectives align step
ends: step ``s`` ends at about the same true time on every rank (within a pipeline's drain,
well under a step). So a rank's clock offset is the median, over recent steps, of its step end
minus the median step end of the job's ranks for that step. A step counts only once a majority
of the job's ranks reported it, so the median is the job's agreement, not whichever ranks
arrived first.

A rank whose offset is beyond ``tolerance`` has its event times shifted by it before windowing
(its data still counts, in the windows it really belongs to); within the tolerance nothing is
shifted, so jitter never moves a record. Until a rank's offset is known, its records are held,
not windowed: a rank 600 s ahead would otherwise open windows 600 s in the future, one 600 s
behind would file into windows already closed. The hold is short (``MIN_STEPS`` steps of a
majority) and bounded: after ``hold_s`` of processing time, or ``MAX_HELD`` records, the ranks
still unknown are taken as they are (offset 0) and their records released; a later estimate
beyond the tolerance still corrects what follows. A job that has sent no step record yet has
nothing to estimate from; its records are windowed as they come (the watermark's agreement
rule keeps one fast clock from dragging the job forward).

Every closed window a correction applied to names the rank and its offset in a ``clock-skew``
finding (:func:`clock_skew_findings`, added to the detectors' findings whatever detectors run),
so that an operator fixes the host's clock. Its score is the alert threshold: the clock needs
fixing, but the data is corrected, so it never outranks a finding that explains a slowdown.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.schemas.records import (
    SPAN_COLUMNS,
    Finding,
    MetricBatch,
    MetricSample,
    SpanBatch,
    StepBatch,
    StepRecord,
    SummaryBatch,
)
from trainscope.schemas.window import WindowView

# A rank's offset is trusted once it rests on this many steps reported by a majority.
MIN_STEPS = 3
# A step's median end is an agreement only among at least this many ranks.
MIN_RANKS = 3
# Step numbers remembered per job: enough for a robust median, bounded state.
KEPT_STEPS = 32
# A step's ranks are measured from its median end, taken again once they grew by this share
# since it was last taken; the ranks that came in between are measured from it as it was (a
# median of at least 63 in 64 of them: a clock offset moves by a fraction of the steps' jitter,
# and offsets are corrected only beyond the tolerance). Taken on every poll, the medians of
# the steps the ranks were still reporting cost a 100,000-rank job ~1 ms per poll.
MEDIAN_RETAKE_SHARE = 1 / 64
# Records held per job while offsets are being estimated, and their rows (span events,
# summary rows): past either, the ranks still unknown are taken as they are.
MAX_HELD = 4096
MAX_HELD_ROWS = 1 << 20
# Offsets beyond this are corrected and reported; within it, clocks are taken as they are.
DEFAULT_TOLERANCE_S = 2.0
FINDING_DETECTOR = "clock-skew"  # the ``detector`` of clock-skew findings

# Rows (StepRecord, MetricSample) only in checkpoints of older versions: the engine holds batches.
Held = SpanBatch | SummaryBatch | StepBatch | MetricBatch | StepRecord | MetricSample


def ranks_of(record: Held) -> list[int]:
    """The ranks whose clocks stamped ``record``."""
    if isinstance(record, StepRecord | MetricSample):
        return [record.rank]
    rank = record.column("rank")
    sole = _sole_rank(rank)
    # Asked of every held record on each release: np.unique took a second of a 100,000-rank
    # job's first window.
    return [sole] if sole is not None else np.unique(rank).tolist()


def _sole_rank(rank: np.ndarray) -> int | None:
    """The one rank of a batch that has one (as a rank's producer sends them), else None."""
    return int(rank[0]) if len(rank) and (rank == rank[0]).all() else None


def rows_of(record: Held) -> int:
    """What ``record`` weighs held: its span events, summary rows, step records or samples."""
    return 1 if isinstance(record, StepRecord | MetricSample) else len(record)


@dataclass
class RankClocks:
    """One job's clock estimates, the corrections applied, and the records held meanwhile."""

    # step -> rank -> end of the step on the rank's own clock (ns)
    ends: dict[int, dict[int, int]] = field(default_factory=dict)
    offsets_ns: dict[int, int] = field(default_factory=dict)  # rank -> correction applied
    steps_used: dict[int, int] = field(default_factory=dict)  # rank -> steps its estimate used
    held: list[tuple[Hashable, Held]] = field(default_factory=list)  # (source, record)
    held_rows: int = 0
    held_since_s: float | None = None
    stepping: bool = False  # the job has sent step records: offsets can be estimated
    ranks: set[int] = field(default_factory=set)  # ranks that sent step records

    def note_steps(self, steps: StepBatch) -> None:
        """Remember each step's end per rank; only the newest ``KEPT_STEPS`` step numbers."""
        self.stepping = True
        rank = steps.column("rank")
        ends = steps.column("start_ns") + steps.column("duration_ns")
        number = steps.column("step")
        # Not a dataclass field (see _step_diffs): per step, the (ranks, ends) arrays of ranks
        # new to it since its diffs were last taken, so those grow by them instead of being
        # read again from the dict (at 10,000 ranks a step gains 256 ranks a poll).
        grown: dict[int, list[tuple[np.ndarray, np.ndarray]]] = vars(self).setdefault(
            "_grown", {})
        cache = vars(self).get("_diffs")
        order = np.argsort(number, kind="stable")
        sorted_steps = number[order]
        cuts = np.flatnonzero(np.diff(sorted_steps)) + 1
        for part in np.split(order, cuts) if len(order) else ():
            step = int(number[part[0]])
            step_ranks, step_ends = rank[part], ends[part]
            by_rank = self.ends.get(step)
            if by_rank is None:
                by_rank = self.ends[step] = {}
            had = len(by_rank)
            by_rank.update(zip(step_ranks.tolist(), step_ends.tolist(), strict=True))
            if len(by_rank) == had + len(part):  # every rank new to the step: it grew by them
                grown.setdefault(step, []).append((step_ranks.astype(np.int64), step_ends))
            else:  # a rank reported the step again: read it afresh next time
                grown.pop(step, None)
                if cache:
                    cache.pop(step, None)
        noted = np.unique(rank)
        self.ranks.update(noted.tolist())
        if len(noted):  # not a field (see _step_diffs): the highest rank, for _dense_diffs
            vars(self)["_top_rank"] = max(int(noted[-1]), vars(self).get("_top_rank", -1))
        # Not a field (see _step_diffs): the ranks whose estimates the next calibrate() owes.
        vars(self).setdefault("_noted", []).append(noted.astype(np.int64))
        if len(self.ends) > KEPT_STEPS:
            for old in sorted(self.ends)[: len(self.ends) - KEPT_STEPS]:
                del self.ends[old]
                grown.pop(old, None)

    def estimates(self, world_size: int) -> dict[int, tuple[int, int]]:
        """Per rank, (offset ns, steps it rests on) from steps a majority of ``world_size``
        ranks reported; ranks with fewer than ``MIN_STEPS`` such steps are left out. The
        medians are ``np.median``'s, taken for all ranks at once (a 10,000-rank job asks on
        every poll that brings step records)."""
        ranks, offsets, used = self._estimate_arrays(world_size)
        return {rank: (offset, steps) for rank, offset, steps
                in zip(ranks.tolist(), offsets.tolist(), used.tolist(), strict=True)}

    def _estimate_arrays(self, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`estimates` as arrays, by rank: ranks, offsets (ns), steps used."""
        quorum = _quorum(world_size)
        rank_parts: list[np.ndarray] = []
        diff_parts: list[np.ndarray] = []
        for step, by_rank in self.ends.items():
            if len(by_rank) < quorum:
                continue
            ranks_diffs = self._step_diffs(step, by_rank)
            rank_parts.append(ranks_diffs[0])
            diff_parts.append(ranks_diffs[1])
        if not rank_parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        lo = min(int(part.min()) for part in rank_parts)
        hi = max(int(part.max()) for part in rank_parts)
        if _dense_enough(hi - lo + 1, max(len(part) for part in rank_parts)):
            return _medians_dense(rank_parts, diff_parts, lo, hi)
        return _medians_sorted(np.concatenate(rank_parts), np.concatenate(diff_parts))

    def _estimates_due(self, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`_estimate_arrays` for the ranks :meth:`calibrate` owes an estimate (by rank,
        of those with ``MIN_STEPS`` majority steps): all of them where a table by rank does
        not fit (ranks numbered sparsely) or most ranks are due anyway."""
        quorum = _quorum(world_size)
        steps = [step for step, by_rank in self.ends.items() if len(by_rank) >= quorum]
        noted: list[np.ndarray] = vars(self).pop("_noted", [])
        before = vars(self).get("_majority_steps", ())
        vars(self)["_majority_steps"] = steps
        if before != steps:
            # A step that just reached its majority gives its ranks a difference each, those
            # that reported it before the majority did included; ranks never estimated
            # (unknown, or taken as they were after the hold) may now have enough steps.
            noted.extend(self._step_diffs(step, self.ends[step])[0]
                         for step in set(steps).difference(before))
            noted.append(np.fromiter(self.ranks - self.steps_used.keys(), dtype=np.int64))
        due = np.unique(np.concatenate(noted)) if noted else np.zeros(0, dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        if not steps or not len(due):
            return empty, empty, empty
        if 2 * len(due) >= len(self.ranks):
            return self._estimate_arrays(world_size)
        dense = []
        for step in steps:
            column = self._dense_diffs(step)
            if column is None:
                return self._estimate_arrays(world_size)
            dense.append(column)
        if int(due[0]) >= 0 and int(due[-1]) < min(len(column) for column in dense):
            columns = [column[due] for column in dense]  # the usual: every due rank inside
        else:
            columns = []
            for column in dense:
                inside = (due >= 0) & (due < len(column))
                columns.append(np.where(inside, column[np.where(inside, due, 0)], _MISSING))
        return _table_medians(np.stack(columns, axis=1), due)

    def _dense_diffs(self, step: int) -> np.ndarray | None:
        """The step's differences by rank (``_MISSING`` where a rank did not report it), kept
        while the step's differences stay the same and grown in place by the ranks new to it
        while its median stays; ``None`` if its ranks are too sparse for a table by rank."""
        ranks, diffs = self._step_diffs(step, self.ends[step])
        dense: dict[int, tuple[np.ndarray, np.ndarray | None, int]] = vars(self).setdefault(
            "_dense", {})
        take = vars(self)["_diffs"][step][6]  # which taking of the step's median
        kept = dense.get(step)
        if kept is not None and kept[0] is diffs:
            return kept[1]
        column: np.ndarray | None = None
        if kept is not None and kept[1] is not None and kept[2] == take:
            # The same median: the step's differences are those kept, and its new ranks'.
            new_ranks, new_diffs = ranks[len(kept[0]):], diffs[len(kept[0]):]
            if len(new_ranks) == 0 or (int(new_ranks.min()) >= 0
                                       and int(new_ranks.max()) < len(kept[1])):
                column = kept[1]
                column[new_ranks] = new_diffs
                dense[step] = (diffs, column, take)
                return column
        size = int(ranks.max()) + 1 if len(ranks) else 0
        if len(ranks) and int(ranks.min()) >= 0 and _dense_enough(size, len(ranks)):
            # Room for the step's ranks to come (the job's ranks so far), so it grows in place.
            top = vars(self).get("_top_rank")  # a job pickled by an older version lacks it
            if top is None:
                top = vars(self)["_top_rank"] = max(self.ranks, default=-1)
            size = max(size, top + 1)
            column = np.full(size, _MISSING, dtype=np.int64)
            column[ranks] = diffs
        dense[step] = (diffs, column, take)
        for old in [s for s in dense if s not in self.ends]:
            del dense[old]
        return column

    def __getstate__(self) -> dict[str, object]:
        # The tables by rank are derived (and at 100,000 ranks tens of MB): not checkpointed.
        return {k: v for k, v in vars(self).items() if k != "_dense"}

    def _step_diffs(self, step: int, by_rank: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The step's ranks and their ends minus the step's median end, kept until the step
        changes: a poll touches a few steps, and re-reading all 32 from their dicts per poll
        was most of the engine's time at 10,000 ranks; a step that gained ranks since grows
        its arrays by them (``note_steps``) instead of re-reading its dict, which grew as
        ranks² over a window. Its median is taken again once its ranks grew by
        ``MEDIAN_RETAKE_SHARE`` since (see there)."""
        # Not dataclass fields: jobs pickled by an older version lack them (snapshots).
        # step -> (ranks reported, ranks, ends, diffs, median, ranks it was taken on, which
        # taking of a median it is)
        cache: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray, int, int, int]] = \
            vars(self).setdefault("_diffs", {})
        grown = vars(self).setdefault("_grown", {})
        cached = cache.get(step)
        if cached is not None and len(cached) != 7:  # an older layout: taken afresh
            cached = None
        if cached is not None and cached[0] == len(by_rank):
            return cached[1], cached[3]
        parts = grown.pop(step, [])
        if cached is not None and cached[0] + sum(len(r) for r, _ in parts) == len(by_rank):
            ranks = np.concatenate([cached[1], *(r for r, _ in parts)])
            ends = np.concatenate([cached[2], *(e for _, e in parts)])
            median, taken, take = cached[4], cached[5], cached[6]
            if len(ends) - taken < MEDIAN_RETAKE_SHARE * taken:
                diffs = np.concatenate([cached[3], *(e - median for _, e in parts)])
                cache[step] = (len(by_rank), ranks, ends, diffs, median, taken, take)
                return ranks, diffs
        else:
            ends = np.fromiter(by_rank.values(), dtype=np.int64, count=len(by_rank))
            ranks = np.fromiter(by_rank.keys(), dtype=np.int64, count=len(by_rank))
        median = int(np.median(ends))
        diffs = ends - median
        take = vars(self)["_median_takes"] = vars(self).get("_median_takes", 0) + 1
        cache[step] = (len(by_rank), ranks, ends, diffs, median, len(ends), take)
        if len(cache) > 2 * KEPT_STEPS:
            for old in [s for s in cache if s not in self.ends]:
                del cache[old]
        return ranks, diffs

    def calibrate(self, world_size: int, tolerance_ns: int) -> list[int]:
        """Take new estimates: a rank not calibrated yet gets its offset (0 within the
        tolerance); a calibrated one only when its clock moved by more than the tolerance (a
        step of its clock), so records are not shuffled by jitter. Returns the ranks changed.

        Estimated on every call, for the ranks whose step records came since the last one (a
        rank taken as it was, offset 0 after the hold, whose steps come after its peers' gets
        its estimate from steps that already had a majority, so no cheaper sign of news will
        do), for the ranks of a step that just reached its majority (once per step, not per
        poll), and for every rank never estimated yet when the majority's steps changed. Any
        other rank's estimate could move only as a step's median moves by peers' jitter: with
        every rank asked on every poll, a 100,000-rank job spent a quarter of a second per poll
        sorting ranks × steps."""
        ranks, offsets, used = self._estimates_due(world_size)
        rank_list = ranks.tolist()
        known = self.offsets_ns
        unknown = np.iinfo(np.int64).min
        is_known, offsets_known = self.lookup(ranks)
        applied = np.where(is_known, offsets_known, unknown)
        wanted = np.where(np.abs(offsets) > tolerance_ns, offsets, 0)
        new = applied == unknown
        moved = ~new & (np.abs(offsets - np.where(new, 0, applied)) > tolerance_ns) & (
            wanted != applied)
        changed = np.flatnonzero(new | moved)
        for i in changed.tolist():
            known[rank_list[i]] = int(wanted[i])
        if len(changed):
            self._offsets_changed()
        self.steps_used.update(zip(rank_list, used.tolist(), strict=True))
        return [rank_list[i] for i in changed.tolist()]

    def lookup(self, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``ranks``: whether its offset is known, and the offset (0 if not):
        the stream job asks for every record it takes in, so from arrays indexed by rank,
        rebuilt only when offsets change."""
        table = vars(self).get("_table")  # not a field: see _step_diffs
        if table is None or table[0] != len(self.offsets_ns):
            table = self._offset_table()
        _, lo, known, offsets = table
        if known is None:  # ranks too sparse for a table
            hits = np.fromiter((r in self.offsets_ns for r in ranks.tolist()), dtype=bool,
                               count=len(ranks))
            return hits, np.fromiter((self.offsets_ns.get(r, 0) for r in ranks.tolist()),
                                     dtype=np.int64, count=len(ranks))
        if not len(known):
            return np.zeros(len(ranks), dtype=bool), np.zeros(len(ranks), dtype=np.int64)
        index = ranks.astype(np.int64) - lo
        inside = (index >= 0) & (index < len(known))
        if inside.all():
            return known[index], offsets[index]
        index = np.where(inside, index, 0)
        return known[index] & inside, np.where(inside, offsets[index], 0)

    def _offset_table(self) -> tuple[int, int, np.ndarray | None, np.ndarray | None]:
        keys = np.fromiter(self.offsets_ns, dtype=np.int64, count=len(self.offsets_ns))
        values = np.fromiter(self.offsets_ns.values(), dtype=np.int64, count=len(keys))
        lo = int(keys.min()) if len(keys) else 0
        size = int(keys.max()) - lo + 1 if len(keys) else 0
        known: np.ndarray | None = None
        offsets: np.ndarray | None = None
        if _dense_enough(size, len(keys)):
            known = np.zeros(size, dtype=bool)
            offsets = np.zeros(size, dtype=np.int64)
            known[keys - lo] = True
            offsets[keys - lo] = values
        table = (len(self.offsets_ns), lo, known, offsets)
        vars(self)["_table"] = table
        return table

    def _offsets_changed(self) -> None:
        vars(self).pop("_table", None)

    def ready(self, record: Held) -> bool:
        return all(rank in self.offsets_ns for rank in ranks_of(record))

    def trust_the_rest(self, records: list[tuple[Hashable, Held]]) -> None:
        """Ranks of ``records`` still unknown are taken as they are (offset 0)."""
        for _, record in records:
            for rank in ranks_of(record):
                self.offsets_ns.setdefault(rank, 0)
        self._offsets_changed()

    def reported(self) -> dict[int, tuple[int, int]]:
        """The corrections in force: rank -> (offset ns, steps it rests on)."""
        return {
            rank: (offset, self.steps_used.get(rank, 0))
            for rank, offset in self.offsets_ns.items()
            if offset
        }


# Ranks are numbered densely from 0: a table by rank is at most this many times larger than the
# ranks it holds (plus a little) before a sparse path (a sort, a dict) is taken instead.
_DENSE_RANKS_PER_ENTRY = 4


def _dense_enough(span: int, entries: int) -> bool:
    """Whether ``entries`` ranks spread over ``span`` rank numbers fit a table by rank."""
    return span <= _DENSE_RANKS_PER_ENTRY * entries + 1024
_MISSING = np.iinfo(np.int64).max  # a rank that did not report a step: sorts last


def _middle(diffs: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The middle value of each run ``diffs[start : start + count]`` (sorted), or the mean of
    the middle two, in float64 as np.median takes it, truncated toward zero as int() does."""
    return ((diffs[starts + (counts - 1) // 2].astype(np.float64)
             + diffs[starts + counts // 2].astype(np.float64)) / 2).astype(np.int64)


def _medians_sorted(ranks: np.ndarray, diffs: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank with ``MIN_STEPS`` differences or more: rank, median difference, count."""
    order = np.lexsort((diffs, ranks))
    ranks, diffs = ranks[order], diffs[order]
    starts = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1]])
    counts = np.diff(np.r_[starts, len(ranks)])
    enough = counts >= MIN_STEPS
    starts, counts = starts[enough], counts[enough]
    return ranks[starts], _middle(diffs, starts, counts), counts


def _medians_dense(rank_parts: list[np.ndarray], diff_parts: list[np.ndarray], lo: int,
                   hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_medians_sorted` of each step's (ranks, differences), a rank at most once per
    step, as a table of ranks ``lo..hi`` by step sorted along its rows: at 10,000 ranks a
    sort of short rows costs a fraction of one sort of every difference by rank."""
    table = np.full((hi - lo + 1, len(rank_parts)), _MISSING, dtype=np.int64)
    for column, (ranks, diffs) in enumerate(zip(rank_parts, diff_parts, strict=True)):
        table[ranks - lo, column] = diffs
    return _table_medians(table, np.arange(lo, hi + 1, dtype=np.int64))


def _table_medians(table: np.ndarray, row_ranks: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``table`` (a rank's differences by step, ``_MISSING`` where it reported
    none) with ``MIN_STEPS`` differences or more: its rank, median difference and count."""
    table.sort(axis=1)
    counts = (table != _MISSING).sum(axis=1)
    rows = np.flatnonzero(counts >= MIN_STEPS)
    counts = counts[rows]
    flat = table[rows].ravel()
    starts = np.arange(len(rows), dtype=np.int64) * table.shape[1]
    return row_ranks[rows], _middle(flat, starts, counts), counts


def _quorum(world_size: int) -> int:
    """Ranks that must have reported a step for its median end to be the job's agreement."""
    return max(MIN_RANKS, world_size // 2 + 1)


def corrected(record: Held, offsets_ns: dict[int, int], window_ns: int) -> Held:
    """``record`` with its times moved from its ranks' clocks to the job's."""
    if isinstance(record, StepRecord):
        offset = offsets_ns.get(record.rank, 0)
        return (
            msgspec.structs.replace(record, start_ns=record.start_ns - offset) if offset
            else record
        )
    if isinstance(record, MetricSample):
        offset = offsets_ns.get(record.rank, 0)
        return msgspec.structs.replace(record, ts_ns=record.ts_ns - offset) if offset else record
    rank = record.column("rank")
    sole = _sole_rank(rank)
    if sole is not None and not offsets_ns.get(sole, 0):
        return record  # one rank's batch, and its clock is the job's
    if isinstance(record, SpanBatch | StepBatch | MetricBatch):
        shift = offsets_of(rank, offsets_ns)
        if not shift.any():
            return record
        field = "ts_ns" if isinstance(record, MetricBatch) else "start_ns"
        times = (record.column(field) - shift).astype(SPAN_COLUMNS["start_ns"])
        return msgspec.structs.replace(record, **{field: times.tobytes()})
    # A summary covers a whole window of its rank's clock: it moves by whole windows (the
    # nearest), as one row; a batch's ranks share a host, hence a clock (else: their median).
    offset = int(np.median(offsets_of(rank, offsets_ns))) if len(rank) else 0
    windows = round(offset / window_ns)
    if not windows:
        return record
    return msgspec.structs.replace(
        record, window_start_ns=record.window_start_ns - windows * window_ns,
        window_end_ns=record.window_end_ns - windows * window_ns,
    )


def offsets_of(rank: np.ndarray, offsets_ns: dict[int, int]) -> np.ndarray:
    """Each event's rank's offset, looked up once per distinct rank (of this record only: a
    pass over every rank's offset per record grows with the job's size)."""
    distinct, inverse = np.unique(rank, return_inverse=True)
    table = np.array([offsets_ns.get(r, 0) for r in distinct.tolist()], dtype=np.int64)
    if not table.any():
        return np.zeros(len(rank), dtype=np.int64)
    return table[inverse.ravel()]


def clock_skew_findings(window: WindowView) -> list[Finding]:
    """One ``clock-skew`` finding per rank whose clock was corrected in ``window``."""
    findings = []
    for rank, (offset_ns, steps) in sorted(window.clock_offsets.items()):
        offset_s = offset_ns / 1e9
        direction = "ahead of" if offset_s > 0 else "behind"
        findings.append(
            window.finding(
                FINDING_DETECTOR,
                rank=rank,
                ranks=[rank],
                category="clock-skew",
                score=ALERT_THRESHOLD,
                evidence={"offset_s": offset_s, "steps": float(steps)},
                message=(
                    f"clock-skew: rank {rank}'s clock is {abs(offset_s):.3f} s {direction} its "
                    f"peers' (median over {steps} steps of its step ends against theirs); its "
                    "event times are corrected by it"
                ),
            )
        )
    return findings
