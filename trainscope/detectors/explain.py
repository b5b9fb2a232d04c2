"""Findings one finding already explains are folded into it, whichever detector made them.

Detectors look at a window each from their own angle, so one fault can be alerted twice: the
ranks of a slow pipeline stage are also each "slower than the job" to a detector that compares
every rank with the whole job (``mixture`` when stages are too small to be peer groups), and a
rank that only waits for a straggler spends more of its step in collectives, which looks like a
slow network. The detectors run independently (and plugins know nothing of each other), so the
runner applies this one piece of cause-versus-victim reasoning to every window's findings after
they all ran:

- a rank inside an alerted ``stage-imbalance`` is not alerted again for the same time as a
  ``slowdown`` or as its own compute: the stage finding says it, with the stage's cost;
- a rank that an alert names as a victim (it waited for the suspect) is not alerted as a
  ``network`` or ``slowdown`` culprit: its waiting is the suspect's cost;
- a rank alerted for its own measured work (its data loader, GC, compute …) is not alerted
  again as ``host`` by the ``waits`` detector for the same straggling: the part of the wait its
  functions do not explain stays in that finding's evidence
  (``outside_instrumented_ns_per_step``);
- under a ``seq-imbalance`` (the job's work per step varies across ranks: tokens, or timing
  alone), alerted or awaiting its confirmation, a rank is not alerted for compute, a slowdown
  or host time by a comparison that did not weigh work per token: the ranks that drew the
  longest sequences compute longer (their GPUs are busier, their peers wait on them) without
  anything wrong with them. Peer-diff compares compute per token when the steps report
  tokens (``evidence["per_token"]``), so a slow GPU it finds beside the imbalance stays an
  alert.

Such a finding is kept, as evidence below the alert threshold, with what explains it in its
message and ``evidence["explained_by_rank"]``; a finding of any other category on such a rank
(its own throttled clock, its own data loader) stays an alert: a second fault is not hidden.
"""

from __future__ import annotations

import msgspec

from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.schemas.records import Finding

# Score of a folded finding: evidence, as the waits detector keeps an explained wait.
EXPLAINED_SCORE = 0.3
# A seq-imbalance finding awaiting its confirmation (capped just under the alert threshold)
# already explains the ranks that drew the most work in its window: in the imbalance's first
# window they would otherwise be alerted, each, for one window.
PENDING_SCORE = 0.45
# A victim waits about what its straggler costs; one whose own excess is more than this many
# times the straggler's is not (only) waiting for it.
VICTIM_EXCESS_RATIO = 2.0
# Windows in a row a rank's groups must have waited on it for it to be a straggler of its own
# rather than one of ranks taking turns waiting for a CPU: a busy host can make a real
# straggler's group also take turns in another collective, and that must not hide it.
PERSISTENT_WINDOWS = 2
# What the ranks of an imbalanced stage look like to a detector that compares them with the
# whole job: the stage's own extra time, not a fault of each rank.
_STAGE_SYMPTOMS = frozenset({"slowdown", "compute", "gpu-compute"})
# What waiting for a straggler looks like on the rank that waits.
_WAITING_SYMPTOMS = frozenset({"slowdown", "network"})
# What longer sequences look like on the ranks that drew them, to a comparison that does not
# weigh work per token (a finding that did says so: ``evidence["per_token"]``).
_LONGER_SEQUENCE_SYMPTOMS = frozenset({"slowdown", "compute", "gpu-compute", "host"})
# A rank's own measured work: a finding of one of these names the straggler with its function.
_OWN_WORK = frozenset({"compute", "gpu-compute", "gpu-throttle", "gpu-memory", "dataloader",
                       "python-gc", "cpu-contention", "pcie"})


def _takes_turns(finding: Finding) -> bool:
    """A job-level finding whose ranks take turns being the slowest: uneven work, or ranks
    taking turns waiting for a CPU (the waits detector's imbalance that moves)."""
    return finding.category == "seq-imbalance" or (
        finding.category == "cpu-contention" and finding.rank < 0)


def fold_explained(findings: list[Finding]) -> list[Finding]:
    """``findings`` of one window of one job, with those another alert explains demoted."""
    alerts = [f for f in findings if (f.score >= ALERT_THRESHOLD and f.rank >= 0)
              or (_takes_turns(f) and f.score >= PENDING_SCORE)]
    if len(alerts) < 2:
        return findings
    waited_on = _waited_on(findings)
    return [_folded(f, alerts, waited_on) if f.score >= ALERT_THRESHOLD and f.rank >= 0 else f
            for f in findings]


def _waited_on(findings: list[Finding]) -> set[int]:
    """Ranks their groups waited on, on average, in this window and the one before (the
    waits detector's late ranks, at any score): stragglers, not ranks taking turns."""
    return {f.rank for f in findings
            if f.rank >= 0 and "peers_wait_ns_per_step" in f.evidence
            and f.evidence.get("consecutive_windows", 0.0) >= PERSISTENT_WINDOWS}


def _waits_more_than_it_costs(finding: Finding, cause: Finding) -> bool:
    """Whether a waiting rank's excess is well beyond the whole excess of the rank it would be
    waiting for: then it is no such victim (a slow link's rank in the DP group of a rank with
    GC pauses waits 182 ms/step, the GC pauses cost 41)."""
    waited = finding.evidence.get("excess_ns_per_step")
    cost = cause.evidence.get("excess_ns_per_step")
    return waited is not None and cost is not None and waited > VICTIM_EXCESS_RATIO * cost


def _folded(finding: Finding, alerts: list[Finding], waited_on: set[int]) -> Finding:
    for cause in alerts:
        if cause is finding:
            continue
        if (cause.category == "seq-imbalance" and finding.category in _LONGER_SEQUENCE_SYMPTOMS
                and not finding.evidence.get("per_token")):
            why = ("the job's seq-imbalance (this rank drew longer sequences or more data "
                   "than its peers)")
        elif (cause.category == "cpu-contention" and cause.rank < 0
                and finding.category in _LONGER_SEQUENCE_SYMPTOMS and finding.rank in cause.ranks
                and finding.rank not in waited_on):
            why = "the job's cpu-contention (its ranks take turns waiting for a CPU)"
        elif (cause.category == "stage-imbalance" and finding.category in _STAGE_SYMPTOMS
                and finding.rank in cause.ranks):
            why = f"part of pipeline stage {cause.pp_stage}'s imbalance"
        elif (finding.category in _WAITING_SYMPTOMS and finding.rank in cause.victims
                and finding.rank != cause.rank and finding.rank not in cause.ranks
                and not _waits_more_than_it_costs(finding, cause)):
            why = f"it waits for rank {cause.rank} ({cause.category})"
        elif (finding.category == "host" and cause.rank == finding.rank
                and cause.category in _OWN_WORK):
            why = f"the same straggler, named with its own {cause.category} ({cause.function})"
        else:
            continue
        return explained(finding, f"{why}, found by {cause.detector}",
                         explained_by_rank=float(cause.rank))
    return finding


def explained(finding: Finding, why: str, **evidence: float) -> Finding:
    """``finding`` kept as evidence below the alert threshold, saying what explains it."""
    return msgspec.structs.replace(
        finding,
        score=min(finding.score, EXPLAINED_SCORE),
        evidence={**finding.evidence, **evidence},
        message=f"{finding.message} [explained: {why}]",
    )
