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
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Source = tuple[str, int]  # (topic, partition)


class PendingOffsets:
    """Per partition, the messages whose windows are not all written yet, in offset order
    (a run of messages that fed the same windows as one: the first of them)."""

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
            queue = self._pending.get(source)
            if queue is None:
                queue = self._pending[source] = deque()
            elif queue and queue[-1][1] == windows:
                # Let go of together with the message before it: only that one's offset can
                # be a position. Most do (a poll's steps of many ranks feed the same window):
                # one entry per run, not per message (millions at 100,000 ranks).
                return newly
            queue.append((offset, windows))
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
        """Runs of messages waiting (see :meth:`add`)."""
        return sum(len(q) for q in self._pending.values())


# A stamp outside these bounds (a hostile or broken producer) is not kept: its batch is taken as
# unstamped, never deduplicated, and the checkpoint stores stamps as 64-bit integers.
_STAMP_LIMIT = 1 << 63


class SeenBatches:
    """Producer stamps (id, sequence) of the batches that fed windows still open, to drop a
    batch a producer re-sent.

    A re-send is the same bytes again, so a stamp counts as seen only together with the digest
    of the payload it came with: a batch whose stamp was damaged into another batch's stamp
    (or two producers that drew the same id) is never taken for a re-send and dropped.

    A stamp is kept until the newest window its batch fed is closed, and the window after it
    too. A re-send after that could feed only closed windows, whose records are set aside and
    counted as late, never merged twice; the window after is kept because a rank's clock
    offset may be estimated again between a batch and its re-send, moving a record across a
    window's edge. So what is kept is bounded by the open windows, however long the job runs
    and however many producers come and go: a number of stamps per producer, kept for as long
    as the process ran, grew by gigabytes an hour at 10,000 ranks and made each checkpoint
    copy millions of them.
    """

    def __init__(self) -> None:
        self._digests: dict[int, dict[int, int]] = {}  # producer id -> seq -> payload digest
        # job -> window index -> flat [producer id, seq, ...] of the batches whose newest
        # window of the job it is
        self._until: dict[str, dict[int, list[int]]] = {}
        # Stamps filed under several jobs (a batch of several jobs' records): jobs still
        # holding them; forgotten when the last lets go.
        self._holders: dict[tuple[int, int], int] = {}
        # (producer id, seq, digest) read from an older checkpoint: see file_unfiled
        self._unfiled: list[tuple[int, int, int]] = []
        # Kept as stamps come and go: read by the metrics endpoint's thread, where iterating
        # the dicts could meet them changing.
        self._count = 0

    def resent(self, producer_id: int, seq: int, digest: int) -> bool:
        """True when the same batch (stamp and payload digest) fed a window still kept."""
        seen = self._digests.get(producer_id)  # never unstamped ones (id 0): see keep
        return seen is not None and seen.get(seq) == digest

    def keep(self, producer_id: int, seq: int, digest: int, windows: dict[str, int]) -> None:
        """Remember a batch that fed ``windows`` (per job, the newest window index it fed)
        until they are closed. Unstamped batches (id 0: an older producer) and batches that
        fed no window are not kept: nothing of theirs could be merged twice."""
        if not windows or not (0 < producer_id < _STAMP_LIMIT and 0 <= seq < _STAMP_LIMIT):
            return
        seen = self._digests.get(producer_id)
        if seen is None:
            seen = self._digests[producer_id] = {}
        elif seq in seen:  # a different batch under a stamp kept: the first one's is kept
            return
        seen[seq] = digest
        self._count += 1
        for job_id, index in windows.items():
            by_index = self._until.get(job_id)
            if by_index is None:
                by_index = self._until[job_id] = {}
            stamps = by_index.get(index)
            if stamps is None:
                by_index[index] = [producer_id, seq]
            else:
                stamps.append(producer_id)
                stamps.append(seq)
        if len(windows) > 1:
            self._holders[(producer_id, seq)] = len(windows)

    def keep_new(self, stamps: list[tuple[int, int, int]], job_ids: list[str],
                 newest: list[int]) -> list[bool]:
        """:meth:`resent` then, for a batch that is not, :meth:`keep`, batch by batch in order,
        for batches of one job each (``newest``: the window of ``job_ids`` each fed): whether
        each is new."""
        resent, keep = self.resent, self.keep
        new: list[bool] = []
        for (producer_id, seq, digest), job_id, index in zip(stamps, job_ids, newest,
                                                             strict=True):
            fresh = not resent(producer_id, seq, digest)
            if fresh:
                keep(producer_id, seq, digest, {job_id: index})
            new.append(fresh)
        return new

    def forget_closed(self, closed_before: Callable[[str], int]) -> None:
        """Forget the stamps of batches whose windows are closed, and the window after them."""
        for job_id, by_index in list(self._until.items()):
            below = closed_before(job_id) - 1
            for index in [i for i in by_index if i < below]:
                self._let_go(by_index.pop(index))
            if not by_index:
                del self._until[job_id]

    def forget_job(self, job_id: str) -> None:
        """A job whose state is forgotten (evicted, or another worker's now)."""
        for stamps in self._until.pop(job_id, {}).values():
            self._let_go(stamps)

    def _let_go(self, stamps: list[int]) -> None:
        digests, holders = self._digests, self._holders
        for i in range(0, len(stamps), 2):
            producer_id, seq = stamps[i], stamps[i + 1]
            if holders:
                left = holders.get((producer_id, seq))
                if left is not None:
                    if left > 1:
                        holders[(producer_id, seq)] = left - 1
                        continue
                    del holders[(producer_id, seq)]
            seen = digests.get(producer_id)
            if seen is not None and seen.pop(seq, None) is not None:
                self._count -= 1
                if not seen:
                    del digests[producer_id]

    def __len__(self) -> int:
        """Stamps kept now."""
        return self._count

    # A checkpoint stores the stamps as arrays per window: one pickle of a few arrays, not of
    # a dict per producer.
    def __getstate__(self) -> dict[str, Any]:
        digests = self._digests
        windows = []
        for job_id, by_index in self._until.items():
            for index, flat in by_index.items():
                stamps = np.array(flat, dtype=np.int64).reshape(-1, 2)
                kept = np.array(
                    [digests[flat[i]][flat[i + 1]] for i in range(0, len(flat), 2)],
                    dtype=np.uint32,
                )
                windows.append((job_id, index, stamps, kept))
        return {"windows": windows}

    def __setstate__(self, state: dict[str, Any]) -> None:
        SeenBatches.__init__(self)
        if "windows" not in state:
            # Written before stamps were kept by window (per producer, without windows): they
            # are kept until the windows open at the restart are closed (file_unfiled).
            self._unfiled = [
                (producer_id, seq, digest)
                for producer_id, seen in state.get("_seen", {}).items()
                for seq, digest in seen.items()
            ]
            return
        # Each stamp with every window it was filed under (several for a batch of several
        # jobs' records), kept again as it was kept the first time.
        fed: dict[tuple[int, int], tuple[int, dict[str, int]]] = {}
        for job_id, index, stamps, kept in state["windows"]:
            for (producer_id, seq), digest in zip(stamps.tolist(), kept.tolist(), strict=True):
                fed.setdefault((producer_id, seq), (digest, {}))[1][job_id] = index
        for (producer_id, seq), (digest, windows) in fed.items():
            self.keep(producer_id, seq, digest, windows)

    def file_unfiled(self, windows: dict[str, int]) -> None:
        """Stamps of an older checkpoint, which did not say which windows their batches fed:
        kept until ``windows`` (per job, the newest window open at the restart) are closed."""
        unfiled, self._unfiled = self._unfiled, []
        for producer_id, seq, digest in unfiled:
            self.keep(producer_id, seq, digest, windows)


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
