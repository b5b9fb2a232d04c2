"""One member per consumer group: the partition assignor of ``trainscope pipeline``.

The stream job keeps each job's windows across all of the job's partitions and stores one
checkpoint per group, so two members that split a group's partitions each see part of every
job: ranks on the other member's partitions look hung, findings are split and step records
written twice. Instead of a balancing assignor, every member of such a group runs
:class:`SoleMemberAssignor`, which gives *every* partition to one member and none to the
others; a member handed nothing knows that another one holds the group and stops (see
:class:`~trainscope.transport.protocol.GroupHeldElsewhere`).

Which member keeps the group is decided by the group leader from what each member sends with
its JoinGroup (``user_data``), the same way in every member, so two members that start at the
same moment agree: a member that held the partitions before this rebalance wins (the running
pipeline is never displaced by a newcomer); among several or none of those, the one that started
first; a tie goes to the smaller member id. Kafka picks one assignment protocol that every
member names, so a member of another kind (a Faust worker, an older pipeline) in the same group
makes the broker refuse the join instead of sharing the partitions.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.cluster import ClusterMetadata
from aiokafka.coordinator.assignors.abstract import AbstractPartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)
from aiokafka.structs import TopicPartition

log = logging.getLogger(__name__)

# The assignment protocol's name: every member of a group must name the same one.
PROTOCOL_NAME = "trainscope-sole-member"


def _claim(metadata: ConsumerProtocolMemberMetadata) -> dict[str, Any]:
    """What a member said about itself; a member that says nothing readable ranks last."""
    try:
        claim = json.loads(bytes(metadata.user_data or b"{}"))
    except ValueError:
        claim = {}
    return claim if isinstance(claim, dict) else {}


class SoleMemberAssignor(AbstractPartitionAssignor):
    """Every partition to one member of the group, none to the others.

    One instance per consumer: it remembers whether its member holds the partitions and tells
    the leader so with each join. ``describe`` names this process in the refusal the other
    members print (``host pid N``).
    """

    name = PROTOCOL_NAME
    version = 0

    def __init__(self, describe: str | None = None) -> None:
        self.started_ns = time.time_ns()
        self.describe = describe or f"{socket.gethostname()} pid {os.getpid()}"
        self.holds = False  # this member was given the partitions in the last generation
        self.holder = ""  # who holds them, as the last assignment said

    def metadata(self, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:  # type: ignore[override]
        claim = {"holds": self.holds, "started_ns": self.started_ns, "who": self.describe}
        return ConsumerProtocolMemberMetadata(
            self.version, sorted(topics), json.dumps(claim).encode()
        )

    def assign(  # type: ignore[override]
        self,
        cluster: ClusterMetadata,
        members: Mapping[str, ConsumerProtocolMemberMetadata],
    ) -> dict[str, ConsumerProtocolMemberAssignment]:
        claims = {member: _claim(meta) for member, meta in members.items()}

        def rank(member: str) -> tuple[bool, int, str]:
            started = claims[member].get("started_ns")
            return (
                claims[member].get("holds") is not True,
                started if isinstance(started, int) else 2**63,
                member,
            )

        winner = min(members, key=rank)
        who = str(claims[winner].get("who", winner)).encode()
        out = {}
        for member, meta in members.items():
            topics: list[ConsumerProtocolMemberAssignment.Assignment] = []
            if member == winner:
                for topic in sorted(meta.subscription):
                    partitions = cluster.partitions_for_topic(topic)
                    if partitions is None:
                        log.warning("no partition metadata for topic %s", topic)
                        continue
                    topics.append(
                        ConsumerProtocolMemberAssignment.Assignment(topic, sorted(partitions))
                    )
            out[member] = ConsumerProtocolMemberAssignment(self.version, topics, who)
        if len(members) > 1:
            log.info("group of %d members: all partitions to %s", len(members), who.decode())
        return out

    def on_assignment(self, assignment: ConsumerProtocolMemberAssignment) -> None:  # type: ignore[override]
        self.holds = bool(assignment.partitions())
        self.holder = bytes(assignment.user_data or b"").decode(errors="replace")


class KeepPositions(ConsumerRebalanceListener):
    """After a rebalance, read on from where this member got to, not from the committed offset.

    A rebalance makes the client fetch every partition from the group's committed offset,
    which lags what the caller already received by up to a commit interval: those messages
    would come twice (and offsets going backwards look like a recreated topic). A partition
    this member held before the rebalance and holds again had no other owner in between (the
    group's partitions are revoked from everybody before they are assigned), so its next
    offset is the one after the last message handed out here.
    """

    def __init__(self) -> None:
        self.consumer: Any = None  # the AIOKafkaConsumer, set once it exists
        self.handed: dict[TopicPartition, int] = {}  # next offset after what poll returned
        self._held: set[TopicPartition] = set()
        self.rebalances = 0  # assignments received so far
        self.rebalancing = False  # partitions revoked, the next assignment not yet received
        self.changes = 0  # revocations and assignments so far

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self.rebalancing = True
        self.changes += 1
        self._held |= set(revoked)  # a join that failed and was retried revokes nothing more

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.rebalances += 1
        self.rebalancing = False
        self.changes += 1
        kept = [tp for tp in assigned
                if tp in self._held and tp in self.handed and self.consumer is not None]
        # Seek before this callback's first await: once the client's fetcher runs, it resets a
        # freshly assigned partition to the committed offset and hands out the messages from
        # there to ours again (a poll in flight returns them: offsets going backwards).
        resumed = {tp: self.handed[tp] for tp in kept}
        for tp, offset in resumed.items():
            self.consumer.seek(tp, offset)
        # Positions of partitions given up are not ours to resume any more.
        for tp in set(self.handed) - set(assigned):
            del self.handed[tp]
        self._held = set()
        await self._unless_the_log_changed(resumed)

    async def _unless_the_log_changed(self, resumed: dict[Any, int]) -> None:
        """Undo the seeks of ``resumed`` (partition -> offset) where the log is not the one
        read before the rebalance.

        A broker that lost its data (its group's commits with it) and came back rejoins the
        group as well: there the position handed out lies past a new, shorter log, and the
        committed offset is gone. Resuming there would skip the new log's messages: such a
        partition is read from its oldest offset (what the client's reset does), one whose
        committed offset does not lead up to ours from the committed offset, and the engine's
        check for a recreated topic applies."""
        if not resumed:
            return
        kept = list(resumed)
        try:
            ends = await self.consumer.end_offsets(kept)
            committed = {tp: await self.consumer.committed(tp) for tp in kept}
        except Exception as exc:  # unsure: the committed offset is the safe place to resume
            log.info("resuming from the committed offsets after a rebalance: %s", exc)
            try:
                await self.consumer.seek_to_committed(*kept)
            except Exception as again:
                log.warning("could not resume from the committed offsets either: %s", again)
            return
        lost = [tp for tp in kept if committed[tp] is None]
        if lost:
            await self.consumer.seek_to_beginning(*lost)
        for tp in kept:
            if committed[tp] is not None and not committed[tp] <= resumed[tp] <= ends[tp]:
                self.consumer.seek(tp, committed[tp])
