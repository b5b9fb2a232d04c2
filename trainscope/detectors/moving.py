"""Imbalance that moves, from timing alone: a group waits every step, on a different member.

When a data-parallel group's work is uneven from step to step (sequence lengths, documents per
batch, anything the script does not report as token counts), its slowest member changes each
step. No rank is late on average, so neither peer-diff nor the late-rank rule of the waits
detector names one, and within a window the imbalance averages out. It shows in each member's
collective time *per call*: a call that waits for a slower member takes longer than the
member's quickest call of the window, the one in which it was the slowest itself and waited for
no one. So ``mean - min`` of a member's calls of the group's collective is what it waited on
average, and in a moving imbalance every member waits about as much. A persistent straggler
does not look like this: it never waits (its mean is its minimum), and the others wait for it
by about the same amount in every call (their minimum is near their mean). Nor does one rank
that stalls now and then: the others wait on it in those steps, it never waits.

Only collectives called at most ``MAX_CALLS_PER_STEP`` times per step are read: several calls
per step (DDP's gradient buckets of different sizes, a TP all-reduce per layer) have minimums
that are those of the smallest call, not of the quickest arrival.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainscope.detectors.features import WAIT_LAYERS, group_codes, steps_per_rank
from trainscope.schemas.window import WindowView

# A job's waiting counts as an imbalance that moves only once it is this many times the job's
# usual level (its earlier windows without one): a job whose steps always jitter (a loaded
# host, OS noise) has that jitter as its level, and an imbalance present from a job's first
# window has no level to stand out from (a stated limit).
RISE_FACTOR = 2.0

# A collective read here is called at most this often per step and rank.
MAX_CALLS_PER_STEP = 1.5
# A group's imbalance moves when at least this share of its members waited at least half the
# group's median wait: the waiting is shared, not one member's ...
SHARED_FRAC = 0.75
# ... and none of them waited less than this share of it: a member that (nearly) never waits is
# the one the others wait on, now and then (a stall of one rank every few steps) or always.
NEVER_WAITS_FRAC = 0.1
# A member waits in many calls, not in all but one: the spread of its calls (their standard
# deviation) is at least this share of its mean wait. One quick call among slow ones (a step
# in which another member happened to be late, a hiccup) puts the minimum far below the mean
# with hardly any spread; waits that come and go with the data spread the calls.
SPREAD_FRAC = 0.3
# No member is late on average: the group's median member spends no more per step in the
# collective than its quickest member, beyond chance (``STRAGGLER_Z`` standard errors of the
# two means) and beyond this share of what the members wait. A persistent straggler spends far
# less there than the others (it never waits, they always wait for it), and on a loaded host,
# or while the closed loop profiles two ranks, its peers' waits also swing from call to call
# around that lateness: what moves then is noise on top of a straggler that the late-rank rule
# names, not an imbalance of the data. In an imbalance that moves, which member drew the least
# work in a window is chance: with few calls or two-member groups, a large share of the wait.
STRAGGLER_FRAC = 0.5
STRAGGLER_Z = 3.0


@dataclass(frozen=True)
class MovingImbalance:
    """The groups whose members take turns being the slowest, and what it costs per step."""

    kind: str  # communicator kind: "dp" or "world"
    function: str  # the collective it shows in
    cost_ns: float  # the median member's wait per step, median over the groups
    groups: int  # groups showing it
    of_groups: int  # groups of that kind read
    ranks: list[int]


@dataclass(frozen=True)
class CollectiveWaits:
    """What each member of one collective's communicators waited and spent in it per step."""

    name: str
    kind: str  # communicator kind: "dp" or "world"
    waited_ns: pd.Series  # per rank: ``mean - min`` of its calls times its calls per step
    spent_ns: pd.Series  # per rank: its whole time in the collective per step
    spent_se_ns: pd.Series  # per rank: the standard error of ``spent_ns``, from its calls


def waited_per_step(
    window: WindowView, layout: pd.DataFrame, kind_of: object,
) -> tuple[list[CollectiveWaits], float | None]:
    """Per collective read: what each member waited per step on average, ``mean - min`` of its
    calls times its calls per step (ns; 0 for a member whose calls hardly spread,
    ``SPREAD_FRAC``), and what it spent in the collective per step. And the window's waiting
    level: the largest over those collectives of the median member's ``mean - min`` per step,
    spread or not (the job's usual level an imbalance must rise above; None when nothing was
    read)."""
    s = window.summaries
    # A summary without a per-call minimum (min_ns 0: not measured) tells nothing here. The
    # columns read are taken before the rows: not the latency sketches' lists (costly to take).
    s = s[["rank", "name", "count", "total_ns", "m2_ns2", "min_ns"]][
        s["layer"].isin(WAIT_LAYERS) & (s["count"] > 0) & (s["min_ns"] > 0)
        & (s["callpath_id"] == 0)]
    if s.empty:
        return [], None
    steps = steps_per_rank(window)
    out = []
    levels: list[float] = []
    for name, rows in s.groupby("name"):
        kind = kind_of(name, layout)  # type: ignore[operator]
        if kind not in ("dp", "world"):
            continue
        rows = rows[rows["rank"].isin(layout.index)]
        if rows.empty or rows.duplicated("rank").any():
            continue  # one summary row per rank: its spread is that of all its calls
        per_rank = rows.set_index("rank")
        calls = per_rank["count"] / steps.reindex(per_rank.index, fill_value=1.0)
        if float(calls.median()) > MAX_CALLS_PER_STEP:
            continue
        mean_ns = per_rank["total_ns"] / per_rank["count"]
        spread_ns = (per_rank["m2_ns2"] / per_rank["count"]).clip(lower=0) ** 0.5
        per_call = mean_ns - per_rank["min_ns"]
        levels.append(float((per_call * calls).median()))
        # Waiting in one call only is no share of the waiting: counted as none.
        per_call = per_call.where(spread_ns >= SPREAD_FRAC * per_call, 0.0)
        out.append(CollectiveWaits(str(name), kind, per_call * calls, mean_ns * calls,
                                   spread_ns / per_rank["count"] ** 0.5 * calls))
    return out, (max(levels) if levels else None)


def moving_imbalance(
    waited: list[CollectiveWaits], layout: pd.DataFrame,
    group_keys: dict[str, tuple[str, ...]], min_cost_ns: float, min_group_size: int,
) -> MovingImbalance | None:
    """The costliest collective in which most groups of one kind show an imbalance that moves
    (each group's median member waits at least ``min_cost_ns`` per step and most members wait
    about as much), or None. A member that drew less work on average in the window may also be
    found late by the waits detector; its group still counts here as long as it is late by
    less than what the members wait (``STRAGGLER_FRAC``): a persistent straggler never waits,
    and its peers wait for it in every call."""
    best: MovingImbalance | None = None
    for collective in waited:
        name, kind, per_member = collective.name, collective.kind, collective.waited_ns
        keys = list(group_keys[kind])
        groups = group_codes(layout.loc[per_member.index], keys)
        read = showing = 0
        costs: list[float] = []
        ranks: list[int] = []
        for _, members in per_member.groupby(groups):
            if len(members) < min_group_size:
                continue
            read += 1
            cost = float(members.median())
            if (cost < min_cost_ns or float((members >= cost / 2).mean()) < SHARED_FRAC
                    or float(members.min()) < NEVER_WAITS_FRAC * cost
                    or _has_straggler(collective, members.index, cost)):
                continue
            showing += 1
            costs.append(cost)
            ranks += [int(r) for r in members.index]
        if not read or showing * 2 <= read:  # uneven data reaches most groups, not a few
            continue
        found = MovingImbalance(kind, name, float(pd.Series(costs).median()), showing,
                                read, sorted(ranks))
        if best is None or found.cost_ns > best.cost_ns:
            best = found
    return best


def _has_straggler(collective: CollectiveWaits, members: pd.Index, cost_ns: float) -> bool:
    """Whether the member that spends least in the collective is late on average: the median
    member spends more than ``STRAGGLER_FRAC`` of the wait and ``STRAGGLER_Z`` standard errors
    more per step."""
    spent = collective.spent_ns.loc[members]
    quickest = spent.idxmin()
    middle = (spent - spent.median()).abs().idxmin()
    lead_ns = float(spent.median() - spent.min())
    se_ns = float(np.hypot(collective.spent_se_ns[quickest], collective.spent_se_ns[middle]))
    return lead_ns > STRAGGLER_FRAC * cost_ns and lead_ns > STRAGGLER_Z * se_ns
