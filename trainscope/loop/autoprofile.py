"""The closed loop: a finding → profiles of the suspect rank and a peer → the call path that
explains the finding, stored with it.

:class:`AutoProfiler` sits beside the stream job. After each closed window
(:meth:`on_window`) its :class:`~trainscope.loop.policy.ProfilePolicy` picks the findings worth
a profile; for each it publishes two :class:`ControlMessage`\\ s on the control topic — "profile
the suspect for K steps" and the same for the peer — through the bus the stream job already
holds. The producers of those ranks profile themselves and send their call-path trees
(:class:`ProfileCallPaths`); the stream job hands every complete tree to :meth:`on_profile`.
Once both of a request's trees are here, the suspect's tree is diffed against the peer's
(:mod:`trainscope.traces.diff`, per step) and the hot chain — the deepest path that explains
the excess, with every path above it — becomes a :class:`FindingCallPath`, written beside the
finding and announced.

Nothing here raises into the stream job: a failed publish or write is logged and counted.
Requests whose profiles do not arrive within ``timeout_s`` (a rank that does not listen for
control messages, a job that ended) are given up and counted. The state (requests awaited, the
policy's last requests) is not checkpointed: after a restart a session in flight is not
completed, and a suspect may be profiled once more.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from trainscope.loop.policy import ProfilePlan, ProfilePolicy, retry_steps
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import (
    ControlMessage,
    Finding,
    FindingCallPath,
    ProfileCallPaths,
)
from trainscope.schemas.topics import CONTROL_TOPIC, rank_key
from trainscope.schemas.window import WindowView
from trainscope.traces.cct import PathTimes
from trainscope.traces.diff import diff, hot_chain, waiting_excess

log = logging.getLogger(__name__)

DEFAULT_STEPS = 5
DEFAULT_TIMEOUT_S = 300.0
# Categories whose cause is the time in collectives itself: a suspect's longer collectives
# are its fault there, not a sign that it waited for its peer.
COLLECTIVE_CATEGORIES = frozenset({"network", "nvlink", "pcie"})

Publish = Callable[[str, bytes, bytes], None]  # topic, value, key


@dataclass
class LoopCounts:
    requested: int = 0  # sessions asked for (two per plan)
    completed: int = 0  # findings that got their call path
    expired: int = 0  # plans whose profiles did not arrive in time
    retried: int = 0  # plans asked again: the first profile did not catch the suspect
    unexpected: int = 0  # profiles nobody here asked for (manual ones, a restart)
    publish_errors: int = 0
    write_errors: int = 0


@dataclass
class _Awaited:
    plan: ProfilePlan
    job_id: str
    suspect_id: str
    peer_id: str
    asked_s: float
    steps: int
    retry: bool = False  # a second profile, the first did not catch the suspect
    trees: dict[str, list[ProfileCallPaths]] = field(default_factory=dict)


class AutoProfiler:
    """``publish(topic, value, key)`` sends on the stream job's bus; ``write(rows)`` stores
    the call paths (``finding_call_paths``); ``announce(line)`` tells the operator."""

    def __init__(
        self,
        publish: Publish,
        write: Callable[[list[FindingCallPath]], None],
        *,
        steps: int = DEFAULT_STEPS,
        policy: ProfilePolicy | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        announce: Callable[[str], None] = log.info,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.publish = publish
        self.write = write
        self.steps = steps
        self.policy = policy if policy is not None else ProfilePolicy(clock=clock)
        self.timeout_s = timeout_s
        self.announce = announce
        self.clock = clock
        self.counts = LoopCounts()
        self._awaited: dict[str, _Awaited] = {}  # by request id (two per plan)
        self.results: list[FindingCallPath] = []

    @property
    def pending(self) -> int:
        return len({id(a) for a in self._awaited.values()})

    # -- after every closed window ----------------------------------------------------------

    def on_window(self, view: WindowView, findings: list[Finding]) -> None:
        try:
            self._expire()
            for plan in self.policy.decide(view, findings, self.pending):
                self._ask(view.job_id, plan)
        except Exception:  # the loop is an extra: the stream job goes on without it
            log.exception("auto-profile: deciding on a window of job %s raised", view.job_id)

    def _ask(self, job_id: str, plan: ProfilePlan, *, retry_of: int = 0) -> None:
        """Ask the plan's two ranks for a profile; ``retry_of``: the steps of a profile that
        did not catch the suspect, asked again longer."""
        base = uuid.uuid4().hex[:12]
        # An intermittent straggler: enough steps for its slow steps.
        steps = retry_steps(retry_of) if retry_of else max(self.steps, plan.cover_steps)
        awaited = _Awaited(plan, job_id, f"auto-{base}-r{plan.suspect}",
                           f"auto-{base}-r{plan.peer}", self.clock(), steps,
                           retry=bool(retry_of))
        now_ns = time.time_ns()
        for rank, request_id in ((plan.suspect, awaited.suspect_id),
                                 (plan.peer, awaited.peer_id)):
            message = ControlMessage(job_id=job_id, action="profile", rank=rank,
                                     steps=steps, request_id=request_id, issued_ns=now_ns)
            try:
                self.publish(CONTROL_TOPIC, encode_batch([message]), rank_key(job_id, rank))
            except Exception as exc:
                self.counts.publish_errors += 1
                log.warning("auto-profile: could not ask job %s rank %d for a profile: %s",
                            job_id, rank, exc)
                return
        self._awaited[awaited.suspect_id] = self._awaited[awaited.peer_id] = awaited
        self.counts.requested += 2
        f = plan.finding
        self.announce(
            f"PROFILE {job_id}: asked rank {plan.suspect} (suspect: {f.category} "
            f"[{f.score:.2f}]) and rank {plan.peer} (peer) for {steps} profiled steps"
            + (" again: the first profile did not catch it holding the job" if retry_of
               else " (its slow steps come now and then)" if steps > self.steps else "")
        )

    def _expire(self) -> None:
        now = self.clock()
        for awaited in {id(a): a for a in self._awaited.values()}.values():
            if now - awaited.asked_s < self.timeout_s:
                continue
            for request_id in (awaited.suspect_id, awaited.peer_id):
                self._awaited.pop(request_id, None)
            self.counts.expired += 1
            missing = [str(r) for r, i in ((awaited.plan.suspect, awaited.suspect_id),
                                           (awaited.plan.peer, awaited.peer_id))
                       if i not in awaited.trees]
            log.warning("auto-profile: job %s: no profile from rank(s) %s within %.0f s "
                        "(does the rank listen for control messages?); given up",
                        awaited.job_id, ", ".join(missing), self.timeout_s)

    # -- when a rank's profile arrives ---------------------------------------------------------

    def on_profile(self, parts: list[ProfileCallPaths]) -> None:
        try:
            self._on_profile(parts)
        except Exception:
            log.exception("auto-profile: a profile of job %s rank %d raised",
                          parts[0].job_id, parts[0].rank)

    def _on_profile(self, parts: list[ProfileCallPaths]) -> None:
        request_id = parts[0].request_id
        awaited = self._awaited.get(request_id)
        if awaited is None:
            self.counts.unexpected += 1
            return
        awaited.trees[request_id] = parts
        if len(awaited.trees) < 2:
            return
        for done in (awaited.suspect_id, awaited.peer_id):
            self._awaited.pop(done, None)
        row, caught = explain(awaited.plan, awaited.trees[awaited.suspect_id],
                              awaited.trees[awaited.peer_id], request_id=awaited.suspect_id)
        self.results.append(row)
        self.counts.completed += 1
        try:
            self.write([row])
        except Exception as exc:
            self.counts.write_errors += 1
            log.error("auto-profile: could not store the call path of job %s rank %d: %s",
                      row.job_id, row.rank, exc)
        self.announce(f"CALL PATH {row.job_id}: {row.message}")
        if not caught and not awaited.retry:
            self.counts.retried += 1
            self._ask(awaited.job_id, awaited.plan, retry_of=awaited.steps)


def tree_times(parts: list[ProfileCallPaths]) -> PathTimes:
    """One session's tree, as the trace diff reads it."""
    times = PathTimes({}, {}, {}, {}, parts[0].steps)
    for p in parts:
        for cp, parent, layer, name, count, total, own in zip(
            p.callpaths, p.parents, p.layers, p.names, p.counts, p.total_ns, p.self_ns,
            strict=True,
        ):
            times.nodes[cp] = (parent, layer, name)
            times.count[cp] = count
            times.total_ns[cp] = total
            times.self_ns[cp] = own
    return times


def explain(plan: ProfilePlan, suspect: list[ProfileCallPaths], peer: list[ProfileCallPaths],
            *, request_id: str = "") -> tuple[FindingCallPath, bool]:
    """The finding's call path: the suspect's tree against the peer's; and False when the
    profile caught the suspect waiting for its peer rather than holding it."""
    f = plan.finding
    deltas = diff(tree_times(suspect), [tree_times(peer)])
    chain = hot_chain(deltas)
    waited_ns = waiting_excess(deltas)
    first = suspect[0]
    common = dict(
        job_id=f.job_id, window_start_ns=f.window_start_ns, window_end_ns=f.window_end_ns,
        detector=f.detector, rank=f.rank, category=f.category, function=f.function,
        score=f.score, peer_rank=plan.peer, request_id=request_id or first.request_id,
        profiled_from_ns=first.started_ns, profiled_to_ns=first.stopped_ns, steps=first.steps,
    )
    if not chain:
        return FindingCallPath(
            **common, per_step=first.steps > 0,  # type: ignore[arg-type]
            message=f"rank {plan.suspect}: no call path takes longer than on rank {plan.peer} "
                    f"over {first.steps} profiled steps",
        ), True
    end = chain[-1]
    unit = "/step" if end.per_step else " over the profile"
    if f.category not in COLLECTIVE_CATEGORIES and waited_ns >= end.delta_ns:
        # The suspect waited in collectives for its peer at least as much as it spent over
        # it anywhere: over these steps it was not the rank holding the job (an intermittent
        # fault between them, or the profiles' own cost evening the ranks out). Its longer
        # paths then are where it waited, not why its peers wait on it.
        return FindingCallPath(
            **common, per_step=end.per_step,  # type: ignore[arg-type]
            message=f"rank {plan.suspect}: the profile did not catch it holding rank "
                    f"{plan.peer}: it waited {waited_ns / 1e6:+.3f} ms{unit} longer in "
                    f"collectives, more than its largest excess ({end.delta_ns / 1e6:+.3f} "
                    f"ms{unit} under {end.path[-1][1]}) over {first.steps} profiled steps; "
                    f"the finding ({f.category} [{f.score:.2f}] by {f.detector}) stands on "
                    "its window's evidence",
        ), False
    # Where the chain holds a record_function label, name the innermost one: it is the user's
    # own name for the block.
    labels = [d for d in chain if d.path[-1][0] == "user_annotation"]
    where = " → ".join(name for _, name in end.path[-3:])
    label = (f" (in record_function '{labels[-1].path[-1][1]}': "
             f"{labels[-1].delta_ns / 1e6:+.3f} ms{unit})" if labels else "")
    by_len = {len(d.path): d.delta_ns for d in chain}
    return FindingCallPath(
        **common,  # type: ignore[arg-type]
        per_step=end.per_step,
        callpath_id=end.callpath_id,
        path=[name for _, name in end.path],
        path_layers=[layer for layer, _ in end.path],
        path_delta_ns=[float(by_len.get(i, 0.0)) for i in range(1, len(end.path) + 1)],
        suspect_ns=end.value_ns,
        peer_ns=end.baseline_ns,
        delta_ns=end.delta_ns,
        message=f"rank {plan.suspect} spends {end.delta_ns / 1e6:+.3f} ms{unit} under {where}"
                f"{label} vs rank {plan.peer} ({first.steps} profiled steps; finding: "
                f"{f.category} [{f.score:.2f}] by {f.detector})",
    ), True
