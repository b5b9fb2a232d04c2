"""Who makes the others wait: localising a straggler from its peers' waiting.

In a synchronous collective every member leaves together, so the rank that arrives last waits
least while the rest of its group waits for it. The producers time every collective from issue
to completion (DDP's gradient buckets as ``ddp_allreduce``, ``torch.distributed`` calls by op and
group), so a straggler shows as the rank whose collective time per step is far *below* its
group's, however its extra time is spent: in a hooked function (peer-diff then also names that
function) or outside every hook — loop-body preprocessing, host-side Python between ops, a noisy
neighbour. The latter is the case this detector exists for: a rank its group consistently waits
on, none of whose measured functions grew, is reported as ``host`` (time outside instrumented
code), with the wait it costs its peers per step and the collective where it shows.

Point-to-point sends and receives are not read: a pipeline's waits there are its schedule's
bubbles as much as a neighbour's lateness.

When no member is late on average but most groups wait every step, on a different member each
time (uneven data or sequence lengths the script does not report as token counts), the groups'
imbalance is reported as ``seq-imbalance`` for the job, with its cost per step
(:mod:`trainscope.detectors.moving`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from trainscope.detectors.features import (
    MAD_TO_SIGMA,
    WAIT_LAYERS,
    group_codes,
    own_work_columns,
    per_step_times,
    runqueue_wait_per_step,
    step_time_ns,
    steps_per_rank,
)
from trainscope.detectors.moving import (
    RISE_FACTOR,
    MovingImbalance,
    moving_imbalance,
    waited_per_step,
)
from trainscope.detectors.params import check_number, check_order
from trainscope.schemas.metrics import SCHED_LAYER
from trainscope.schemas.records import Finding
from trainscope.schemas.window import WindowView

DETECTOR = "waits"
CATEGORY = "host"
MOVING_CATEGORY = "seq-imbalance"
CONTENTION_CATEGORY = "cpu-contention"
# Members that take turns being the slowest because they take turns waiting for a CPU (more
# runnable threads than cores): each one's run-queue wait per step, the median member's, is at
# least this share of what the members wait in the collective. In a group of N members whose
# delays come one at a time, each member waits up to N - 1 times its own run-queue wait (the
# late one's delay, less its own): at 4 members, a third; data imbalance on a quiet host has
# next to none.
CONTENTION_EXPLAINS_FRAC = 0.25
# Windows of an imbalance's run whose run-queue wait and cost are summed for that judgement: a
# contended host's ranks wait for a CPU in bursts, so a single window can show little of it
# while the turns go on; a judgement over the run's last few windows does not flip with them.
CONTENTION_WINDOWS = 4
# Earlier windows whose waiting level forms the job's usual level (2 minutes at 15-s windows).
WAIT_LEVEL_WINDOWS = 8
# Point-to-point exchanges: their waits are pipeline bubbles as much as lateness (not read).
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
# Score cap for a rank not yet waited on in ``confirm_windows`` windows in a row (peer-diff's).
UNCONFIRMED_SCORE_CAP = 0.45
# Score cap when the rank's own measured work grew enough to explain the wait: peer-diff names
# that function, so this finding stays evidence, not a second alert for the same rank.
EXPLAINED_SCORE_CAP = 0.3
# Its own measured work explains the wait when it grew by at least this share of it.
EXPLAINED_FRAC = 0.5
# Confidence of a rank exactly at z_min; it grows linearly to 1 at z_full.
MIN_CONFIDENCE = 0.5
# The smallest spread a per-step collective time is judged against, as a share of the step.
NOISE_FLOOR_STEP_FRAC = 0.002
# A member waiting at least this share of the straggler's cost more than it is its victim.
VICTIM_WAIT_FRAC = 0.5
MAX_VICTIMS = 64
# A group of two has no robust reference: which of a pair waits less can be its structure (who
# issues first), not lateness; the pair's lateness shows in the larger groups around it.
MIN_GROUP_SIZE = 3
# Group kinds, read from the layout: the ranks that share each kind's communicator.
_GROUP_KEYS = {"dp": ("pp_stage", "tp_rank"), "tp": ("pp_stage", "dp_rank"), "world": ()}


@dataclass
class _Late:
    rank: int
    kind: str
    function: str
    wait_ns: float  # how much longer its group waits than it, per step
    value_ns: float
    reference_ns: float
    z: float
    victims: list[int]


class WaitDetector:
    """Finds the rank its collective groups wait on, whether or not a hooked function grew.

    Each window, every rank's collective time per step is summed per communicator kind — its
    data-parallel group (DDP's ``ddp_allreduce``, ``ddp_pre_forward``, collectives labelled
    ``dp``), its tensor-parallel group (labelled ``tp``), or the whole job (collectives on the
    default group; ``[size=N]`` goes to the kind whose groups have N ranks; point-to-point
    exchanges are not read). Within each group of 3 ranks or more of the layout, the reference is
    the median of the upper half of the members' times — what the ranks that wait spend, even when
    a few of them are late — and the robust spread is the MAD of that upper half. A rank at least
    ``z_min`` spreads below the reference, by at least ``min_wait_ns`` and ``min_wait_frac`` of the
    step, is one its group waits on: the gap is the wait it costs each peer per step. One that
    waited at least half as long in its other communicators (a TP partner, a pipeline receive)
    is late because it waited for someone else there: a victim, not named. Its score is
    a confidence from the z (0.5 at ``z_min``, 1 at ``z_full``), capped at 0.45 until it has been
    waited on ``confirm_windows`` windows in a row. If its own measured work (compute, data
    loading, GC …) grew over its group's by at least half that wait, peer-diff already names it
    with the function: the finding is kept as evidence at 0.3, never a second alert. Otherwise its
    extra time is outside instrumented code: category ``host``, with the step time its hooked
    functions do not explain, against its peers', in the evidence. A job whose ranks all slow down
    together names no rank.

    State, kept across windows and pickled with checkpoints: for each rank, how many windows in
    a row its group waited on it. Nothing is learned before the first window, and the pipeline
    gives every job its own copy.

    Parameters
    ----------
    z_min : float, default 4.0 (robust z)
        Robust z below the waiting members' time at which a rank is one its group waits on. The
        spread is floored at ``rel_floor`` of the reference, so a straggler is found even when
        its peers wait for it to the microsecond.
    z_full : float, default 8.0 (robust z)
        Robust z at which the confidence reaches 1. Must be above ``z_min``.
    rel_floor : float, default 0.05 (fraction of the reference)
        The smallest spread, as a share of the waiting members' collective time: at the
        defaults a rank must wait at least 20% less than its peers to count at all.
    min_wait_ns : float, default 2e6 (ns per step)
        The wait a rank must cost its peers per step to be reported ...
    min_wait_frac : float, default 0.02 (fraction of the step)
        ... and at least this share of the job's step time: less is not worth anyone's time.
    confirm_windows : int, default 2 (windows)
        Windows in a row a rank must be waited on before it can alert; until then its score is
        capped at 0.45. A straggler persists; a hiccup of a busy host does not.
    moving_min_frac : float, default 0.05 (fraction of the step)
        An imbalance that moves is reported when the median member of most groups waits at
        least this share of the step (and ``min_wait_ns``) per step, and twice the job's usual
        level of waiting (the median over its last 8 earlier windows without one: its own
        jitter); its confidence
        reaches 1 at twice ``moving_min_frac``, and it too must hold ``confirm_windows``
        windows in a row. It is read only when the steps report no token counts: with them,
        step-time names the imbalance. An imbalance present from the job's first window is not
        read (there is no level to rise from).

    Examples
    --------
    Two windows of a job of 2 stages × 4 ranks whose rank 5 runs its backward pass 1.4 times
    slower: every other rank waits for it in the job-wide all-reduce. Its own backward grew by
    about half that wait, and peer-diff names that function, so from the second window on the
    finding here stays evidence (0.3), not a second alert for the same rank:

    >>> from trainscope.detectors.contract import example_windows
    >>> detector = WaitDetector()
    >>> first, second = example_windows(2, slow_rank=5)
    >>> [(f.rank, f.category, f.function, f.score) for f in detector.detect(first)]
    [(5, 'host', 'all_reduce', 0.45)]
    >>> finding, = detector.detect(second)
    >>> finding.score, finding.victims
    (0.3, [0, 1, 2, 3, 4, 6, 7])
    >>> round(finding.evidence["peers_wait_ns_per_step"] / 1e6)  # ms per step
    165
    """

    name = DETECTOR

    def __init__(
        self,
        z_min: float = 4.0,
        z_full: float = 8.0,
        rel_floor: float = 0.05,
        min_wait_ns: float = 2e6,
        min_wait_frac: float = 0.02,
        confirm_windows: int = 2,
        moving_min_frac: float = 0.05,
    ) -> None:
        check_number(DETECTOR, "z_min", z_min, gt=0)
        check_number(DETECTOR, "moving_min_frac", moving_min_frac, gt=0, lt=1)
        check_number(DETECTOR, "z_full", z_full, gt=0)
        check_order(DETECTOR, "z_min", z_min, "z_full", z_full)
        check_number(DETECTOR, "rel_floor", rel_floor, gt=0, lt=1)
        check_number(DETECTOR, "min_wait_ns", min_wait_ns, ge=0)
        check_number(DETECTOR, "min_wait_frac", min_wait_frac, ge=0, lt=1)
        check_number(DETECTOR, "confirm_windows", confirm_windows, ge=1, integer=True)
        self.z_min = z_min
        self.z_full = z_full
        self.rel_floor = rel_floor
        self.min_wait_ns = min_wait_ns
        self.min_wait_frac = min_wait_frac
        self.confirm_windows = confirm_windows
        self.moving_min_frac = moving_min_frac
        self._streaks: dict[int, int] = {}
        self._moving_streak = 0  # windows in a row with an imbalance that moves
        self._moving_last: MovingImbalance | None = None  # the last window's, if any
        # (run-queue wait, cost) per step of the run's last windows, ns: CONTENTION_WINDOWS.
        self._moving_runqueue: list[tuple[float, float]] = []
        # The waiting levels (shares of the step) of the last earlier windows without an
        # imbalance that moves: the job's own jitter, which such an imbalance must rise above.
        self._wait_levels: list[float] = []

    def __setstate__(self, state: dict[str, object]) -> None:
        # A checkpoint written before a setting existed restores with that setting's default.
        self.__dict__.update({**WaitDetector().__dict__, **state})

    def detect(self, window: WindowView) -> list[Finding]:
        waits = _collective_times(window)
        if waits.empty:
            self._streaks = {}
            self._moving_streak = 0
            self._moving_runqueue = []
            return []
        step_ns = step_time_ns(window)
        layout = window.rank_layout().reindex(waits.index)
        late: dict[int, _Late] = {}
        for kind in _GROUP_KEYS:
            columns = [c for c in waits.columns if _kind_of(c, layout) == kind]
            if not columns:
                continue
            for found in self._late_ranks(waits, columns, layout, kind, step_ns):
                if found.rank not in late or found.wait_ns > late[found.rank].wait_ns:
                    late[found.rank] = found
        self._streaks = {r: self._streaks.get(r, 0) + 1 for r in late}
        findings = self._moving(window, layout, step_ns)
        if late:
            own = per_step_times(window)
            findings += [self._finding(window, layout, own, s, step_ns) for s in late.values()]
        findings.sort(key=lambda f: f.score, reverse=True)
        return findings

    def _moving(self, window: WindowView, layout: pd.DataFrame, step_ns: float) -> list[Finding]:
        """The job's imbalance that moves, read from timing when no token counts came."""
        found: MovingImbalance | None = None
        steps = window.steps
        if np.isfinite(step_ns) and step_ns > 0 and (
                steps.empty or not (steps["tokens"] > 0).any()):
            waited, level = waited_per_step(window, layout, _kind_of)
            if self._wait_levels:
                usual = float(np.median(self._wait_levels))
                min_cost = max(self.min_wait_ns, self.moving_min_frac * step_ns,
                               RISE_FACTOR * usual * step_ns)
                found = moving_imbalance(waited, layout, _GROUP_KEYS, min_cost, MIN_GROUP_SIZE)
            if level is not None and found is None:
                self._wait_levels = [*self._wait_levels, level / step_ns][-WAIT_LEVEL_WINDOWS:]
        # A confirmed imbalance does not vanish in one window: a window too short to show it
        # (the job's last, a few steps) keeps it pending, so that the ranks that drew the most
        # work in those steps are still explained by it rather than alerted as late.
        held = (self._moving_last if found is None and self._moving_streak >= self.confirm_windows
                else None)
        self._moving_streak = self._moving_streak + 1 if found is not None else 0
        self._moving_last = found
        if found is None:
            finding = [] if held is None else [self._moving_finding(
                window, held, held.cost_ns / step_ns, UNCONFIRMED_SCORE_CAP, step_ns)]
            self._moving_runqueue = []
            return finding
        self._moving_runqueue = [*self._moving_runqueue, (
            _median_runqueue_ns(window, found.ranks) or 0.0, found.cost_ns)][-CONTENTION_WINDOWS:]
        frac = found.cost_ns / step_ns
        confidence = float(np.clip(
            MIN_CONFIDENCE + (1 - MIN_CONFIDENCE) * (frac / self.moving_min_frac - 1.0),
            MIN_CONFIDENCE, 1.0))
        # Held for confirmation as a late rank is: a window in which the closed loop profiled
        # a rank, or a few hiccups, can have every member waiting on a different one. Pending,
        # it already explains the ranks that drew the most work (detectors/explain.py).
        score = confidence
        if self._moving_streak < self.confirm_windows:
            score = min(score, UNCONFIRMED_SCORE_CAP)
        return [self._moving_finding(window, found, frac, score, step_ns)]

    def _moving_finding(self, window: WindowView, found: MovingImbalance, frac: float,
                        score: float, step_ns: float) -> Finding:
        ms = 1e-6
        measured = _median_runqueue_ns(window, found.ranks)
        runqueue_ns = measured or 0.0
        # The imbalance's last windows (this one's included when it showed the imbalance).
        run = self._moving_runqueue or [(runqueue_ns, found.cost_ns)]
        run_runqueue_ns = sum(r for r, _ in run) / len(run)
        run_cost_ns = sum(c for _, c in run) / len(run)
        evidence = {"wait_ns_per_step": found.cost_ns, "step_ns": step_ns,
                    "groups": float(found.groups), "of_groups": float(found.of_groups),
                    "consecutive_windows": float(self._moving_streak)}
        if measured is not None or run_runqueue_ns > 0:
            # What the judgement below reads: the run's last windows, this one's figure beside.
            evidence["runqueue_wait_ns_per_step"] = run_runqueue_ns
            evidence["runqueue_windows"] = float(len(run))
            evidence["window_runqueue_wait_ns_per_step"] = runqueue_ns
        turns = (f"the slowest member of {found.groups} of {found.of_groups} "
                 f"{found.kind.upper()} groups changes from step to step")
        cost = (f"their members wait {found.cost_ns * ms:.0f} ms/step in "
                f"collective/{found.function} on whichever is slowest, {frac:.0%} of the step")
        if run_runqueue_ns >= CONTENTION_EXPLAINS_FRAC * run_cost_ns:
            # Not the data: the ranks take turns waiting for a CPU. A host matter, no one rank's.
            category = CONTENTION_CATEGORY
            over = "" if len(run) == 1 else f" over the last {len(run)} windows"
            message = (f"{category}: {turns} as they take turns waiting for a CPU (each spends "
                       f"{run_runqueue_ns * ms:.1f} ms/step{over} runnable without one: more "
                       f"busy threads than cores); {cost}")
        else:
            category = MOVING_CATEGORY
            message = (f"{category}: {turns} (uneven data or sequence lengths; the steps "
                       f"report no token counts): {cost}")
        return window.finding(
            self.name, ranks=found.ranks, layer="collective", function=found.function,
            category=category, score=round(score, 4), message=message, evidence=evidence,
        )

    def _late_ranks(
        self, every: pd.DataFrame, columns: list[str], layout: pd.DataFrame, kind: str,
        step_ns: float,
    ) -> list[_Late]:
        """The ranks of each group of ``kind`` whose members wait on them (one per rank)."""
        waits = every[columns]
        total = waits.sum(axis=1, min_count=1)
        # What each rank waited in its other communicators (TP, pipeline sends, …): a rank late
        # here because it waited there for someone else is that one's victim, not a straggler.
        elsewhere = every.drop(columns=columns).fillna(0.0).sum(axis=1)
        keys = list(_GROUP_KEYS[kind])
        groups = group_codes(layout, keys)
        floor = NOISE_FLOOR_STEP_FRAC * step_ns if np.isfinite(step_ns) else 0.0
        min_wait = max(self.min_wait_ns, self.min_wait_frac * step_ns if np.isfinite(step_ns)
                       else 0.0)
        # Each group's reference and spread for all groups at once (a job of 10,000 ranks has
        # thousands of groups); only the few late ranks are then looked at one by one.
        valid = total.dropna()
        codes = groups.reindex(valid.index)
        large = codes.map(codes.value_counts()) >= MIN_GROUP_SIZE
        valid, codes = valid[large], codes[large]
        if valid.empty:
            return []
        by_group = valid.groupby(codes)
        upper = valid.where(valid >= by_group.transform("median"))
        reference = upper.groupby(codes).transform("median")
        mad = (upper - reference).abs().groupby(codes).transform("median")
        spread = np.maximum(np.maximum(MAD_TO_SIGMA * mad, self.rel_floor * reference), floor)
        wait_of = reference - valid
        late = (spread > 0) & (wait_of / spread >= self.z_min) & (wait_of >= min_wait)
        # In the order of the groups, then of the ranks within each (as a pass group by group).
        order = pd.DataFrame({"code": codes[late], "at": np.flatnonzero(late.to_numpy())})
        found: list[_Late] = []
        for rank in order.sort_values(["code", "at"], kind="stable").index:
            members = valid[codes == codes[rank]]
            value = float(valid[rank])
            wait = float(wait_of[rank])
            z = wait / float(spread[rank])
            waited = float(elsewhere[rank] - elsewhere[members.index].median())
            if waited >= EXPLAINED_FRAC * wait:
                continue
            # The collective where it shows: the one it spends least in against its group.
            function = str(waits.loc[rank].sub(waits.loc[members.index].median()).idxmin())
            victims = [int(r) for r, v in members.items()
                       if r != rank and v - value >= VICTIM_WAIT_FRAC * wait][:MAX_VICTIMS]
            found.append(_Late(int(rank), kind, function, wait, value, float(reference[rank]),
                               z, victims))
        return found

    def _finding(self, window: WindowView, layout: pd.DataFrame, own: pd.DataFrame, s: _Late,
                 step_ns: float) -> Finding:
        group = [s.rank, *s.victims]
        own_excess, outside = _own_and_outside(window, own, s.rank, group)
        explained = own_excess >= EXPLAINED_FRAC * s.wait_ns
        confidence = float(np.clip(
            MIN_CONFIDENCE + (1 - MIN_CONFIDENCE) * (s.z - self.z_min) / (self.z_full - self.z_min),
            MIN_CONFIDENCE, 1.0))
        score = confidence
        if self._streaks.get(s.rank, 0) < self.confirm_windows:
            score = min(score, UNCONFIRMED_SCORE_CAP)
        if explained:
            score = min(score, EXPLAINED_SCORE_CAP)
        ms = 1e-6
        where = ""
        if s.rank in layout.index:
            row = layout.loc[s.rank]
            where = f" (dp {row['dp_rank']}, stage {row['pp_stage']}, tp {row['tp_rank']})"
        if explained:
            why = f"its own measured work grew {own_excess * ms:.0f} ms/step, which explains it"
        elif outside is None:
            why = ("none of its measured functions explains it (its time outside instrumented "
                   "code is not known: no step record of it or its peers in this window)")
        else:
            why = (f"none of its measured functions explains it: {outside * ms:+.0f} ms/step "
                   "outside instrumented code against its peers")
        message = (
            f"{CATEGORY}: rank {s.rank}{where}: its {s.kind.upper()} group waits on it "
            f"{s.wait_ns * ms:.0f} ms/step in collective/{s.function} ({s.value_ns * ms:.0f} "
            f"ms/step of collectives vs {s.reference_ns * ms:.0f} ms on the waiting peers); "
            f"{why}; {len(s.victims)} rank(s) wait on it"
        )
        evidence = {
            "peers_wait_ns_per_step": s.wait_ns,
            "value_ns_per_step": s.value_ns,
            "reference_ns_per_step": s.reference_ns,
            "z": s.z,
            "own_excess_ns_per_step": own_excess,
            "consecutive_windows": float(self._streaks.get(s.rank, 0)),
        }
        # What is not known is left out: a window without step records (a stall) has neither.
        if np.isfinite(step_ns):
            evidence["step_ns"] = step_ns
        if outside is not None:
            evidence["outside_instrumented_ns_per_step"] = outside
        return window.finding(
            self.name, rank=s.rank, ranks=[s.rank], victims=s.victims,
            pp_stage=int(layout.loc[s.rank, "pp_stage"]) if s.rank in layout.index else -1,
            layer="collective", function=s.function, category=CATEGORY, score=round(score, 4),
            message=message,
            evidence=evidence,
        )


def _collective_times(window: WindowView) -> pd.DataFrame:
    """ns per step in each collective a rank took part in (NaN where it took no part)."""
    s = window.summaries
    # The columns read before the rows: a row filter of every column takes the latency
    # sketches' lists too, which cost more than the rest of the window's work here.
    s = s[["rank", "name", "total_ns"]][s["layer"].isin(WAIT_LAYERS) & (s["count"] > 0)]
    if s.empty:
        return pd.DataFrame()
    table = s.pivot_table(index="rank", columns="name", values="total_ns", aggfunc="sum")
    return table.div(steps_per_rank(window).reindex(table.index, fill_value=1.0), axis=0)


def _kind_of(name: str, layout: pd.DataFrame) -> str | None:
    """The communicator kind a collective's name points to (None: not one to read).

    Read from the words of the name and its group label: ``all_reduce[tp]``, the simulator's
    ``tp_all_reduce``, DDP's ``ddp_allreduce``; anything that sends or receives point to point
    (``send``, ``irecv``, ``pp_send``) is not read."""
    base, _, label = name.partition("[")
    label = label.rstrip("]").lower()
    words = set(re.split(r"[^a-z0-9]+", f"{base.lower()} {label}")) - {""}
    if words & P2P_OPS or words & {"pp", "p2p"}:
        return None
    if words & {"dp", "ddp", "fsdp", "data"} or base.startswith("ddp_"):
        return "dp"
    if words & {"tp", "tensor"}:
        return "tp"
    if not label:
        return "world"
    if label.startswith("size="):
        size = label.removeprefix("size=")
        for kind, keys in _GROUP_KEYS.items():
            sizes = layout.groupby(list(keys)).size() if keys else pd.Series([len(layout)])
            if size.isdigit() and sizes.nunique() == 1 and int(sizes.iloc[0]) == int(size):
                return kind
    return None


def _own_and_outside(window: WindowView, own: pd.DataFrame, rank: int,
                     group: list[int]) -> tuple[float, float | None]:
    """(how much the rank's own measured work exceeds its group's median, how much more of its
    step no hooked function explains than its group's median, or None where the window has no
    step record of the rank or of its peers), both ns per step."""
    columns = own_work_columns(own.columns)
    members = [r for r in group if r in own.index]
    if rank not in own.index or len(members) < 2:
        return 0.0, 0.0
    work = own.loc[members, columns]
    own_excess = float((work.loc[rank] - work.median()).clip(lower=0).sum())
    steps = window.steps
    if steps.empty:
        return own_excess, None
    step_per_rank = steps.groupby("rank")["duration_ns"].mean().reindex(members)
    # A wait for a CPU is not a function of its own: it happened inside hooked code or outside.
    hooked = own.loc[members, [c for c in own.columns if c[0] not in ("step", SCHED_LAYER)]
                     ].sum(axis=1)
    unexplained = step_per_rank - hooked
    outside = float(unexplained[rank] - unexplained.drop(rank).median())
    return own_excess, outside if np.isfinite(outside) else None


def _median_runqueue_ns(window: WindowView, ranks: list[int]) -> float | None:
    """The median of ``ranks``' run-queue wait per step; None where none of them measured it."""
    runqueue = runqueue_wait_per_step(window).reindex(ranks).dropna()
    return float(runqueue.median()) if len(runqueue) else None
