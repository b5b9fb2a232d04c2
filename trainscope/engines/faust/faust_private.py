"""faust-streaming's private API as trainscope uses it, in one place, for faust-streaming 0.15.3.

faust-streaming has no public hook for what :mod:`trainscope.engines.faust.consumer` changes —
when a fetched message counts as read, which offset gets committed — so the rebalance-safe
consumer replaces two private methods and works on the bookkeeping behind them. Every name of
Faust's that starts with an underscore is reached through this module and nowhere else:

- :class:`PrivateHooks` gives the two private methods Faust calls on its consumer names of ours;
  it checks when the consumer is built that Faust still calls them and that the bookkeeping
  attributes below exist, so another version fails at start, not in the middle of a job;
- the functions read or change that bookkeeping; a missing attribute raises
  :class:`FaustPrivateApiError` naming it and the version expected, never a default that would
  quietly turn a safeguard off;
- :data:`UPSTREAM_DIGESTS` records the source of every upstream function our code copies,
  replaces or relies on; ``tests/engines/faust/test_faust_private.py`` names each one that
  differs in the installed faust-streaming.

pyproject.toml pins faust-streaming to exactly this version. Moving the pin means reading each
changed function against our code, then recording its new digest here.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from faust.transport.consumer import Consumer as FaustBaseConsumer
from faust.transport.drivers.aiokafka import Consumer
from faust.types import TP

from trainscope.schemas.errors import TrainscopeError

FAUST_VERSION = "0.15.3"

# "module:Class.function" → digest of its normalised source (tests/upstream_source.py computes
# it; a comment or a reformat does not change it, a changed line does).
UPSTREAM_DIGESTS: dict[str, str] = {
    # Copied into RebalanceSafeConsumer.drain_messages, with our hand-over rules in its loop.
    "faust.transport.consumer:Consumer._drain_messages": "8660847fe71dd3a9",
    # Its only caller, Fetcher._fetcher, must still hand it the fetcher.
    "faust.transport.consumer:Fetcher._fetcher": "e4abc4a5f6f194a7",
    # Replaced by committable_offset; _filter_committable_offsets commits what it returns.
    "faust.transport.consumer:Consumer._new_offset": "d7cb5936949a89db",
    "faust.transport.consumer:Consumer._filter_committable_offsets": "5b8862400836588f",
    # Wrapped (ack, perform_seek, on_partitions_revoked) or replaced (seek).
    "faust.transport.consumer:Consumer.ack": "88131267e994bcec",
    "faust.transport.consumer:Consumer.seek": "ec01087885565832",
    "faust.transport.consumer:Consumer.perform_seek": "047da9bff84a2113",
    "faust.transport.consumer:Consumer.on_partitions_revoked": "9e8d4d298976c985",
    # Our seeks: in the consumer's thread, setting the read offsets as seek() does.
    "faust.transport.consumer:ThreadDelegateConsumer.seek_wait": "6b0a8ec3583a8654",
    "faust.transport.drivers.aiokafka:AIOKafkaConsumerThread._seek_wait": "bad782ba2a8cf3a9",
    # A stream acknowledges the messages it skips during a rebalance; ack() refuses those.
    # (With Faust's Cython extension the skip itself is in faust/_cython/streams.pyx, which
    # mirrors _py_aiter and has no Python source to compare.)
    "faust.streams:Stream._py_aiter": "6d4bd939923d4674",
    "faust.streams:Stream._c_aiter": "b5adc00a01b1a2a8",
    # aiokafka_producer().
    "faust.transport.drivers.aiokafka:Producer._ensure_producer": "346e1a962882b615",
}

# The private methods Faust calls on its consumer that PrivateHooks renames.
HOOKS = ("_drain_messages", "_new_offset")
# The consumer's private bookkeeping that the functions below use.
CONSUMER_ATTRIBUTES = (
    "_read_offset",
    "_committed_offset",
    "_acked",
    "_acked_index",
    "_n_acked",
    "_commit_every",
    "_stopped",
)


def installed_version() -> str:
    try:
        return version("faust-streaming")
    except PackageNotFoundError:
        return "not installed"


class FaustPrivateApiError(RuntimeError, TrainscopeError):
    """The installed faust-streaming lacks an internal that trainscope's consumer relies on."""

    def __init__(self, owner: object, name: str) -> None:
        where = owner.__qualname__ if isinstance(owner, type) else type(owner).__qualname__
        super().__init__(
            f"{where} has no attribute {name!r}: trainscope's Faust consumer is written for "
            f"faust-streaming {FAUST_VERSION}, and {installed_version()} is installed"
        )


def _private(owner: object, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise FaustPrivateApiError(owner, name) from None


class PrivateHooks(Consumer):
    """Faust's aiokafka consumer with its two private hooks under names of ours: the fetcher
    runs ``_drain_messages`` (→ :meth:`drain_messages`) for as long as the consumer reads, and
    each commit asks ``_new_offset`` (→ :meth:`offset_to_commit`) per partition."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for hook in HOOKS:
            # Faust calls these on its own base class; one it no longer has would leave ours
            # silently unused.
            if hook not in vars(FaustBaseConsumer):
                raise FaustPrivateApiError(FaustBaseConsumer, hook)
        super().__init__(*args, **kwargs)
        for name in CONSUMER_ATTRIBUTES:
            _private(self, name)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - see the hook
        await self.drain_messages(fetcher)

    def _new_offset(self, tp: TP) -> int | None:
        return self.offset_to_commit(tp)

    async def drain_messages(self, fetcher: Any) -> None:
        """Hand fetched messages to the agents until the consumer or ``fetcher`` stops."""
        raise NotImplementedError

    def offset_to_commit(self, tp: TP) -> int | None:
        """The offset to commit for ``tp`` now, or None to leave it where it is."""
        raise NotImplementedError


def read_offsets(consumer: Consumer) -> MutableMapping[TP, int | None]:
    """``_read_offset``: per partition, the offset last marked read (None: none). Faust's seeks
    and its table recovery set it; a missing key reads as None."""
    offsets: MutableMapping[TP, int | None] = _private(consumer, "_read_offset")
    return offsets


def committed_offset(consumer: Consumer, tp: TP) -> int | None:
    """``_committed_offset[tp]``: the committed position Faust knows of (None: none)."""
    offset: int | None = _private(consumer, "_committed_offset")[tp]
    return offset


def acknowledged(consumer: Consumer, tp: TP) -> tuple[list[int], set[int]]:
    """``_acked[tp]`` and ``_acked_index[tp]``: the offsets acknowledged and not committed yet,
    as a list and a set, which the committer takes a run out of."""
    return _private(consumer, "_acked")[tp], _private(consumer, "_acked_index")[tp]


def commit_every(consumer: Consumer) -> int | None:
    """``_commit_every``: commit after this many acknowledgements (None: by interval only)."""
    every: int | None = _private(consumer, "_commit_every")
    return every


def take_commit_due(consumer: Consumer, every: int) -> bool:
    """True once ``every`` messages were acknowledged since the last time (``_n_acked``), which
    then counts from 0 again."""
    if _private(consumer, "_n_acked") < every:
        return False
    consumer._n_acked = 0
    return True


def stop_requested(service: Any) -> Callable[[], bool]:
    """Whether ``service`` (a mode service: the consumer, its fetcher) was told to stop: the
    ``is_set`` of its ``_stopped`` event."""
    stopped = _private(service, "_stopped")
    is_set: Callable[[], bool] = stopped.is_set
    return is_set


def aiokafka_producer(producer: Any) -> Any:
    """The aiokafka producer behind Faust's ``app.producer`` (``_ensure_producer``); Faust's
    ``NotReady`` before the app started it."""
    return _private(producer, "_ensure_producer")()
