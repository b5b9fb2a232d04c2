"""What the stream job may commit, which batches it has seen, and how it waits between retries.

Commit rule: per partition, the position committed is the offset of the earliest message whose
records still sit in a window that is open (or closed but not yet written). Everything before it
fed only windows that are written, so a restart re-reads exactly what it needs to rebuild every
window that was not written — complete, never from part of its input.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Source = tuple[str, int]  # (topic, partition)


class PendingOffsets:
    """Per partition, the messages whose windows are not all written yet, in offset order."""

    def __init__(self) -> None:
        # (offset, {job_id: newest window index the message fed}) per partition
        self._pending: dict[Source, deque[tuple[int, dict[str, int]]]] = {}
        self._next: dict[Source, int] = {}
        # When one partition is found recreated, the broker has likely lost them all: the
        # others' positions are not committed until each delivers again, since a position
        # from the old log would skip the new one.
        self._suspect: set[Source] = set()
        self._restarted: set[Source] = set()  # seen to restart since the loss was noticed

    def add(self, source: Source, offset: int, windows: dict[str, int]) -> list[Source]:
        """A message was handled; ``windows`` maps each job in it to the newest window it fed
        (empty when it fed none: rejected, duplicate, late, or only topology).

        Returns the partitions newly suspected of a replaced log (when this one went back):
        they should be read from their beginning, since a broker that lost one log has likely
        lost them all, and a position in the old log may lie past the end of the new one."""
        newly: list[Source] = []
        known = self._next.get(source)
        if known is not None and offset < known - 1:
            # The partition went back: the topic was recreated (a broker that lost its data).
            # What was pending there cannot be re-read from this broker any more.
            log.warning(
                "%s[%d] restarted at offset %d after %d: the topic was recreated; "
                "positions start over", source[0], source[1], offset, known,
            )
            self._pending.pop(source, None)
            self._restarted.add(source)
            newly = sorted(set(self._next) - self._restarted - self._suspect)
            self._suspect.update(newly)
        self._suspect.discard(source)
        if not self._suspect:
            self._restarted.clear()
        self._next[source] = offset + 1
        if windows:
            self._pending.setdefault(source, deque()).append((offset, windows))
        return newly

    def positions(self, closed_before: Callable[[str], int]) -> dict[Source, int]:
        """The committable position per partition: all windows of the jobs below
        ``closed_before(job)`` are closed and written."""
        out: dict[Source, int] = {}
        for source, next_offset in self._next.items():
            if source in self._suspect:
                continue
            queue = self._pending.get(source)
            while queue and all(
                index < closed_before(job) for job, index in queue[0][1].items()
            ):
                queue.popleft()
            out[source] = queue[0][0] if queue else next_offset
        return out

    def forget(self, source: Source) -> None:
        """A partition this consumer no longer reads (taken over by another)."""
        self._pending.pop(source, None)
        self._next.pop(source, None)
        self._suspect.discard(source)
        self._restarted.discard(source)

    def read_positions(self) -> dict[Source, int]:
        """Per partition, the position after the last message read (partitions suspected of a
        replaced log excepted)."""
        return {s: o for s, o in self._next.items() if s not in self._suspect}

    def pending(self) -> int:
        return sum(len(q) for q in self._pending.values())


@dataclass
class SeenBatches:
    """Producer stamps (id, sequence) seen recently, to drop batches a producer re-sent.

    A re-send is the same bytes again, so a stamp counts as seen only together with the digest
    of the payload it came with: a batch whose stamp was damaged into another batch's stamp
    (or two producers that drew the same id) is never taken for a re-send and dropped.
    A re-send follows its original closely, so per producer only the newest ``horizon``
    sequence numbers are remembered; memory stays bounded however long the job runs.
    """

    horizon: int = 1 << 20
    _seen: dict[int, dict[int, int]] = field(default_factory=dict)  # id -> seq -> digest
    _newest: dict[int, int] = field(default_factory=dict)

    def first_time(self, producer_id: int, seq: int, digest: int = 0) -> bool:
        if producer_id == 0:  # unstamped: an older producer; nothing to compare
            return True
        seen = self._seen.setdefault(producer_id, {})
        known = seen.get(seq)
        if known is not None:
            return known != digest
        seen[seq] = digest
        newest = max(self._newest.get(producer_id, seq), seq)
        self._newest[producer_id] = newest
        if len(seen) > 2 * self.horizon:
            floor = newest - self.horizon
            self._seen[producer_id] = {s: d for s, d in seen.items() if s > floor}
        return True

    def recent(self, per_producer: int) -> SeenBatches:
        """A copy that remembers only each producer's newest ``per_producer`` stamps: what a
        checkpoint keeps, since a re-send follows its original closely."""
        copy = SeenBatches(horizon=self.horizon)
        for producer_id, seen in self._seen.items():
            floor = self._newest[producer_id] - per_producer
            copy._seen[producer_id] = {s: d for s, d in seen.items() if s > floor}
            copy._newest[producer_id] = self._newest[producer_id]
        return copy


@dataclass
class Backoff:
    """Exponential backoff with jitter, and a log line on the first failure only."""

    what: str
    initial_s: float = 0.2
    max_s: float = 10.0
    failures: int = 0
    _next_try: float = 0.0

    def ready(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._next_try

    def failed(self, error: object) -> float:
        """Record a failure; returns the delay before the next try."""
        self.failures += 1
        if self.failures == 1:
            log.warning("%s failed: %s; retrying with backoff", self.what, error)
        delay = min(self.max_s, self.initial_s * 2 ** min(self.failures - 1, 16))
        delay *= 0.5 + random.random() / 2
        self._next_try = time.monotonic() + delay
        return delay

    def reset(self) -> None:
        """Allow the next try at once (the caller bounds the tries itself)."""
        self._next_try = 0.0

    def succeeded(self) -> None:
        if self.failures:
            log.warning("%s works again after %d failed tries", self.what, self.failures)
        self.failures = 0
        self._next_try = 0.0
