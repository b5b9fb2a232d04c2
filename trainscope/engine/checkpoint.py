"""What the stream job stores with each offset commit, and how a restart resumes from it.

A checkpoint holds the job's whole state at a point of the input: the open windows as received
(not yet merged), which windows are written, the detectors' state, the producer stamps seen
lately, the world sizes declared, and per partition the position it covers. With the open
windows in it, the positions committed to the bus are simply everything read so far, so a
restart re-reads only what arrived after the last commit (``commit_interval_s``), not the open
windows.

The checkpoint is stored before the positions are committed. The bus's committed position is
therefore the checkpoint's own or, after a crash between the two, the one of the commit before
(``committed``): the messages between them are already in the checkpoint and a restarted job
skips them (:class:`ResumeFilter`). A position further back than both means the broker lost the
log and a new one began; nothing is skipped then.

An open-window snapshot larger than ``max_open_bytes`` is not stored (a very large job at a
short commit interval): that checkpoint falls back to the rule of
:mod:`trainscope.engine.delivery`, positions that re-read every open window in full.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainscope.detectors.registry import DetectorRunner
from trainscope.engine.delivery import SeenBatches, Source
from trainscope.engine.keys import FunctionTable
from trainscope.engine.state import JobState
from trainscope.schemas.records import Topology

log = logging.getLogger(__name__)

VERSION = 2
# Compressed size above which the open windows are not snapshotted (see the module docstring).
DEFAULT_MAX_OPEN_BYTES = 64 << 20


@dataclass
class Checkpoint:
    closed_before_ns: dict[str, int] = field(default_factory=dict)
    topologies: dict[str, Topology] = field(default_factory=dict)
    world_sizes: dict[str, int] = field(default_factory=dict)
    runner: DetectorRunner | None = None
    seen: SeenBatches | None = None
    # WindowEngine.snapshot(); None when the positions re-read the open windows instead.
    engine: dict[str, Any] | None = None
    positions: dict[Source, int] = field(default_factory=dict)  # covered by this checkpoint
    committed: dict[Source, int] = field(default_factory=dict)  # on the bus before it
    version: int = VERSION
    # ExtraState.save() of each hook, by name (plain data). A class-level default, not a
    # factory: a checkpoint pickled before this field existed reads as None.
    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class ExtraState:
    """State a hook of the stream job keeps outside the engine (the Alertmanager notifier's
    alerts), checkpointed with the job's own so that it matches the positions committed.

    ``save`` runs on the job's thread with each checkpoint and returns plain data (no
    trainscope classes: the engine does not import what it stores); equal values mean nothing
    changed. ``restore`` gets it back when a restarted job reads the checkpoint, before the job
    polls, and raises ValueError for state it cannot use (the job then goes on without it)."""

    save: Callable[[], Any]
    restore: Callable[[Any], None]


def encode(checkpoint: Checkpoint) -> bytes:
    try:
        blob = pickle.dumps(checkpoint, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # a plugin detector that does not pickle
        log.warning("detector state not checkpointed: %s", exc)
        checkpoint = dataclasses.replace(checkpoint, runner=None)
        blob = pickle.dumps(checkpoint, protocol=pickle.HIGHEST_PROTOCOL)
    return zlib.compress(blob, 1)


class _JobOfStreamsLayout:
    """A job's window state as the ``trainscope.streams`` layout (0.1.0, before the engine had a
    package of its own) pickled it; :func:`_upgrade_engine` turns it into a :class:`JobState`."""

    __dict__: dict[str, Any]


# Where the classes a checkpoint pickles lived in the trainscope.streams layout. A checkpoint
# holds a running job's open windows while the bus's positions already cover them, so a job
# upgraded across the move must read the old one, or those windows would be lost.
_STREAMS_LAYOUT: dict[tuple[str, str], tuple[str, str] | type] = {
    ("trainscope.streams.checkpoint", "Checkpoint"): ("trainscope.engine.checkpoint", "Checkpoint"),
    ("trainscope.streams.delivery", "SeenBatches"): ("trainscope.engine.delivery", "SeenBatches"),
    ("trainscope.streams.windows", "_Job"): _JobOfStreamsLayout,
    ("trainscope.streams.windows", "_Window"): ("trainscope.engine.state", "OpenWindow"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        moved = _STREAMS_LAYOUT.get((module, name))
        if isinstance(moved, type):
            return moved
        if moved is not None:
            module, name = moved
        elif module.startswith("trainscope.streams."):
            raise ValueError(f"{module}.{name} of the trainscope.streams layout has no new place")
        return super().find_class(module, name)


def _upgrade_engine(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    if not snapshot:
        return snapshot
    jobs = snapshot.get("jobs", {})
    for job_id, job in list(jobs.items()):
        if isinstance(job, _JobOfStreamsLayout):
            old = job.__dict__
            jobs[job_id] = JobState(
                base=old["base"],
                closed_before=old["closed_before"],
                restored_before=old["restored_before"],
                functions=FunctionTable(
                    ids=old["functions"], layer=old["fn_layer"], name=old["fn_name"],
                    callpath=old["fn_callpath"],
                ),
                topology=old.get("topology"),
            )
    return snapshot


def decode(blob: bytes) -> Checkpoint:
    """Raises ValueError for a checkpoint this version cannot read."""
    try:
        state = _Unpickler(io.BytesIO(zlib.decompress(blob))).load()
    except Exception as exc:
        raise ValueError(f"unreadable checkpoint: {type(exc).__name__}: {exc}") from None
    if isinstance(state, Checkpoint):
        state.engine = _upgrade_engine(state.engine)
        return state
    if isinstance(state, dict):  # version 1: written windows and detectors only
        runner = state.get("runner")
        return Checkpoint(
            closed_before_ns=dict(state.get("closed_before_ns", {})),
            topologies=dict(state.get("topologies", {})),
            runner=runner if isinstance(runner, DetectorRunner) else None,
            version=1,
        )
    raise ValueError(f"unreadable checkpoint: a {type(state).__name__}")


class ResumeFilter:
    """Skips the messages a restored checkpoint already holds (see the module docstring)."""

    def __init__(self, positions: dict[Source, int], committed: dict[Source, int]) -> None:
        self._positions = dict(positions)
        self._committed = committed
        self._decided: set[Source] = set()
        self.skipped = 0

    def skip(self, source: Source, offset: int) -> bool:
        position = self._positions.get(source)
        if position is None:
            return False
        if source not in self._decided:
            # The first message read from the partition says where the bus resumed.
            self._decided.add(source)
            before = self._committed.get(source)
            if offset >= position or (before is not None and offset < before):
                del self._positions[source]
                if offset < position:
                    log.warning(
                        "%s[%d] resumed at offset %d, before the last commit (%d): the broker's "
                        "log was replaced; reading it all", source[0], source[1], offset, before,
                    )
                return False
        if offset < position:
            self.skipped += 1
            return True
        del self._positions[source]
        return False

    @property
    def active(self) -> bool:
        return bool(self._positions)
