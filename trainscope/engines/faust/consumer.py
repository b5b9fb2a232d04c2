"""faust-streaming's Kafka consumer, made not to skip messages across rebalances or commits.

faust-streaming 0.15.3 can mark messages read, or commit their offsets, though no agent
finished them. Over the test broker, with one of two workers killed mid-job, records were lost
with nothing counting them. Four mechanisms, each replaced here:

- **Hand-over cut short.** Each fetched message is handed to the agents while the consumer
  waits on the rebalance flag, and it is marked read whichever finished first. A rebalance
  that cuts a hand-over short leaves a message marked read that no agent saw.
- **Records from before a seek.** When records fetched before the post-rebalance seek are
  handed over after it, the offsets between the seek and them are booked as a "gap", which
  Faust counts as acknowledged and commits; the records fetched again from the seek are then
  dropped as read.
- **Skipped messages acknowledged.** A stream that reads a message while a rebalance holds
  the flow, or one of an earlier generation of the group, drops it and acknowledges it, even
  with acknowledgements off; with nothing committed yet, the read position stays where it was.
  The dropped message's offset was committed though no agent saw it.
- **Commits past unacknowledged messages.** Faust commits the first run of consecutive
  acknowledged offsets without checking that it starts at the committed position when the
  partition has none yet (or it is 0), and lets it start one past it otherwise. An agent that
  acknowledges out of order — the rekey agent, whose forwards to different partitions complete
  in any order — thus had offsets committed whose forwards were still in flight.

:class:`RebalanceSafeConsumer` keeps its own next offset to hand over per partition and its
own commit base:

- after every rebalance, each partition the agents read is sought to its committed offset, or
  to the start of its log where the group committed none, so whatever a stream dropped comes
  again;
- a message is handed over only if it is the next one; one beyond it (fetched before a seek, or
  after a cut-short hand-over) makes the consumer seek back to the next one, so it is fetched
  again. trainscope's topics are neither compacted nor transactional: their offsets have no holes.
- a message whose hand-over did not finish, and the rest of a batch during which a seek ran, are
  not marked read; they are fetched again.
- when a fetch brings nothing, the fetch positions are checked against what was handed over
  (at most once a second): records Faust's fetch loop fetched but dropped at the end of a
  partition, where no later record shows the hole, are fetched again.
- seeks run in the consumer's own thread (Faust's ``seek`` calls aiokafka from the worker's
  thread, after which the fetcher at times never woke again).
- acknowledgements made while a rebalance holds the flow, or for a message of an earlier
  generation, are not recorded: the message comes again.
- the committed offset moves only over a run of acknowledged offsets that starts exactly at the
  committed position (:func:`committable_offset`).

Agents may thus receive a message twice; the Faust app recognises repeats (see
:mod:`trainscope.engines.faust.app`). Only ``_drain_messages`` (otherwise as in faust-streaming
0.15.3), ``_new_offset``, ``ack``, ``seek``, ``perform_seek`` and ``on_partitions_revoked`` are
replaced. Faust's private names are reached only through
:mod:`~trainscope.engines.faust.faust_private`, which records the upstream source of each of these
(faust-streaming is pinned to exactly 0.15.3 for that reason).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from faust.transport.consumer import CONSUMER_FETCHING
from faust.types import TP
from faust.utils.functional import consecutive_numbers

from trainscope.engines.faust import faust_private
from trainscope.engines.faust.faust_private import PrivateHooks

log = logging.getLogger(__name__)


def committable_offset(acked: list[int], acked_index: set[int], base: int | None) -> int | None:
    """The offset to commit for a partition whose messages before ``base`` are committed, and
    ``acked`` (with its set ``acked_index``) acknowledged since: the end of the run of
    consecutive acknowledged offsets that starts at ``base``, or None if ``base`` itself is not
    acknowledged (or unknown). The run is taken out of ``acked``; offsets below ``base``
    (acknowledged again after they were committed) are dropped."""
    if base is None or not acked:
        return None
    acked.sort()
    below = 0
    while below < len(acked) and acked[below] < base:
        below += 1
    if below:
        acked_index.difference_update(acked[:below])
        del acked[:below]
    if not acked or acked[0] != base:
        return None
    run = next(consecutive_numbers(acked))
    del acked[: len(run)]
    acked_index.difference_update(run)
    return run[-1] + 1


class RebalanceSafeConsumer(PrivateHooks):
    """faust-streaming's aiokafka consumer that hands each message over once it is the next one
    of its partition and commits only runs of acknowledged offsets (see the module docstring).

    Owns, per partition it reads, the next offset to hand over and the base of its commits; a
    counter of seeks tells the records fetched before one from those after it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Next offset to hand over; None: whatever comes first (no committed position).
        self._next_handover: dict[TP, int | None] = {}
        # Where commits start on a partition with no committed position: its first offset read.
        self._first_read: dict[TP, int | None] = {}
        self._seeks = 0  # changes with every seek: records fetched before one are stale
        self._next_check_s = 0.0  # of _catch_dropped

    async def perform_seek(self) -> None:
        """Position every stream partition at its committed offset, or at the start of its
        log where the group committed none. Faust's own seek leaves a partition without a
        committed offset where it was; what the agents' streams skipped meanwhile (a stream
        drops the messages it reads while a rebalance holds the flow) would not come again."""
        await super().perform_seek()
        changelogs = self.app.tables.changelog_topics  # positioned by table recovery
        streams = [tp for tp in self.assignment() if tp.topic not in changelogs]
        read_offsets = faust_private.read_offsets(self)
        positions = {tp: read_offsets[tp] for tp in streams}
        uncommitted = [tp for tp, offset in positions.items() if offset is None]
        if uncommitted:
            try:
                earliest = await self.earliest_offsets(*uncommitted)
            except Exception as exc:  # the first fetch of each decides, as before
                log.warning("log starts of %s unknown (%s): reading on from where they are",
                            uncommitted, exc or type(exc).__name__)
                earliest = {}
            starts = {tp: start for tp in uncommitted
                      if (start := earliest.get(tp)) is not None and start >= 0}
            if starts:
                await self.seek_wait(starts)  # in the consumer's thread, see seek()
                positions.update(starts)
        for tp, offset in positions.items():
            self._next_handover[tp] = offset
            self._first_read[tp] = offset
        self._seeks += 1
        log.info("reading on from %s", ", ".join(
            f"{tp.topic}[{tp.partition}]@{offset}" for tp, offset in sorted(positions.items())))

    def ack(self, message: Any) -> bool:
        # A Faust stream that reads a message while a rebalance holds the flow, or one fetched
        # before the group's current generation, skips it and acknowledges it ("so that lag
        # does not grow"), even on a stream with acknowledgements off: its offset would be
        # committed though no agent saw it. Such acknowledgements are not recorded. Nor are
        # an agent's own for those messages; every partition is read again from its committed
        # position after a rebalance (perform_seek), so each comes again and is acknowledged
        # then.
        app = self.app
        if (not app.flow_control.is_active()
                or message.generation_id != app.consumer_generation_id):
            return False
        return super().ack(message)

    async def on_partitions_revoked(self, revoked: set[TP]) -> None:
        await super().on_partitions_revoked(revoked)
        for tp in revoked:
            self._next_handover.pop(tp, None)
            self._first_read.pop(tp, None)

    async def seek(self, partition: TP, offset: int) -> None:
        await self._seek_to({partition: offset})

    async def _seek_to(self, offsets: dict[TP, int]) -> None:
        # Faust's seek() calls aiokafka from this thread while the consumer runs in its own:
        # now and then its fetcher then never wakes, and the worker stops reading for good.
        # seek_wait seeks in the consumer's thread (setting the read offsets as seek() does)
        # and waits for the new positions.
        await self.seek_wait(offsets)
        self._next_handover.update(offsets)
        self._seeks += 1

    def offset_to_commit(self, tp: TP) -> int | None:
        base = faust_private.committed_offset(self, tp)
        if base is None:
            base = self._first_read.get(tp)
        acked, acked_index = faust_private.acknowledged(self, tp)
        return committable_offset(acked, acked_index, base)

    async def _catch_dropped(self) -> None:
        """Nothing came: make sure the fetch position is not past what was handed over.
        Faust's own fetch loop may drop records it fetched (a partition briefly inactive, the
        flow stopped mid-batch); a later record would show the hole, but at the end of a
        partition none comes. At most once a second."""
        now = asyncio.get_running_loop().time()
        if not self.flow_active or now < self._next_check_s:
            return  # a rebalance seeks every partition anyway (perform_seek)
        self._next_check_s = now + 1.0
        assigned = self.assignment()
        behind: dict[Any, int] = {}
        for tp, expected in list(self._next_handover.items()):
            if expected is None or tp not in assigned:
                continue
            try:
                position = await self.position(tp)
            except Exception as exc:  # revoked meanwhile
                log.debug("no position for %s: %s", tp, exc)
                continue
            if position is not None and position > expected:
                log.info("%s: offsets %d..%d were fetched but not handed over", tp, expected,
                         position - 1)
                behind[tp] = expected
        if behind:
            await self._refetch(behind)

    async def _refetch(self, first_unread: dict[Any, int]) -> None:
        # A partition taken away is read from its committed offset by its new owner.
        assigned = self.assignment()
        offsets = {tp: offset for tp, offset in first_unread.items() if tp in assigned}
        if not offsets:
            return
        log.info("fetching again from %s", ", ".join(
            f"{tp.topic}[{tp.partition}]@{offset}" for tp, offset in sorted(offsets.items())))
        try:
            await self._seek_to(offsets)
        except Exception as exc:  # revoked meanwhile: the same as above
            log.debug("could not seek to %s: %s", offsets, exc)

    async def drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - see module doc
        """faust-streaming 0.15.3's ``Consumer._drain_messages`` (Faust's fetcher runs it for as
        long as the consumer reads), handing a message over only if it is the next one of its
        partition and marking it read only once the hand-over finished.

        Long because it is upstream's loop with our hand-over rules inside it, kept in one piece
        so that it reads side by side with upstream (whose digest faust_private records).
        """
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = faust_private.stop_requested(self)
        fetcher_should_stop = faust_private.stop_requested(fetcher)
        read_offsets = faust_private.read_offsets(self)
        get_read_offset = read_offsets.__getitem__
        set_read_offset = read_offsets.__setitem__
        next_handover = self._next_handover
        first_read = self._first_read
        set_flag, unset_flag = self.diag.set_flag, self.diag.unset_flag
        commit_every = faust_private.commit_every(self)
        yield_every = 100
        since_yield = 0
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                set_flag(CONSUMER_FETCHING)
                ait = getmany(timeout=1.0)
                await self.sleep(0)
                if self.should_stop:
                    continue
                first_unread: dict[Any, int] = {}
                changelogs = self.app.tables.changelog_topics
                # A seek while this batch is handed over (Faust's own after a rebalance, ours
                # below) makes the rest of it stale: the positions the seek set stand, and
                # what the streams dropped meanwhile comes again from there.
                seeks = self._seeks
                stale = False
                handed = 0
                async for tp, message in ait:
                    offset = message.offset
                    if tp in first_unread:
                        continue
                    stale = stale or self._seeks != seeks
                    if stale and tp.topic not in changelogs:
                        # Fetched before a seek: nothing more of it is handed over, and each
                        # partition in it is fetched again from its next offset.
                        expected = next_handover.get(tp)
                        if expected is not None:
                            first_unread[tp] = expected
                        continue
                    since_yield += 1
                    if since_yield > yield_every:
                        await asyncio.sleep(0)
                        since_yield = 0
                    if tp.topic in changelogs:
                        # Table recovery seeks these itself (seek_wait); Faust's rule.
                        r_offset = get_read_offset(tp)
                        if r_offset is not None and offset < r_offset:
                            continue
                        await self.wait_first(callback(message), self.suspend_flow.wait())
                        set_read_offset(tp, offset)
                        continue
                    expected = next_handover.get(tp)
                    if expected is not None and offset < expected:
                        continue  # handed over already
                    if expected is not None and offset > expected:
                        log.info("%s: offsets %d..%d were not handed over", tp, expected,
                                 offset - 1)
                        first_unread[tp] = expected
                        continue
                    if commit_every is not None and faust_private.take_commit_due(
                            self, commit_every):
                        await self.commit()
                    handover = callback(message)
                    waited = await self.wait_first(handover, self.suspend_flow.wait())
                    if self._seeks != seeks or handover not in waited.done:
                        # Cut short by a rebalance, or a seek meanwhile: it comes again.
                        if next_handover.get(tp) is not None:
                            first_unread[tp] = next_handover[tp]
                        continue
                    if first_read.get(tp) is None:
                        first_read[tp] = offset
                    next_handover[tp] = offset + 1
                    set_read_offset(tp, offset)
                    handed += 1
                if first_unread:
                    await self._refetch(first_unread)
                elif not handed:
                    await self._catch_dropped()
                unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        finally:
            unset_flag(CONSUMER_FETCHING)


def use_rebalance_safe_consumer(app: Any) -> None:
    """Make ``app`` (a faust.App not started yet) consume with :class:`RebalanceSafeConsumer`."""
    app.transport.Consumer = RebalanceSafeConsumer
