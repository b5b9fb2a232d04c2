"""aiokafka's private API as the Kafka bus uses it, in one place, for aiokafka 0.14.0.

aiokafka has no public call for three things the bus needs: failing the batches a producer still
holds when the bus gives it up during an outage, leaving a consumer group whose first generation
is numbered 0 (as Tansu numbers it), and closing the connections of a client whose ``stop``
failed. Every attribute of aiokafka's that is private or undocumented is reached through this
module and nowhere else:

- each function names the attribute it uses; a missing one raises
  :class:`AiokafkaPrivateApiError` naming it and the version expected, never a default that
  would quietly make the call do nothing. Callers on shutdown paths, where carrying on is right,
  catch it and log it once (:func:`warn_once`);
- :data:`UPSTREAM_DIGESTS` records the source of every upstream function whose behaviour the bus
  relies on; ``tests/transport/test_aiokafka_private.py`` names each one that differs in the
  installed aiokafka.

pyproject.toml pins aiokafka to exactly this version. Moving the pin means reading each changed
function against our use of it, then recording its new digest here.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.protocol.group import LeaveGroupRequest

from trainscope.schemas.errors import TrainscopeError

log = logging.getLogger(__name__)

AIOKAFKA_VERSION = "0.14.0"

# "module:Class.function" → digest of its normalised source (tests/upstream_source.py computes
# it; a comment or a reformat does not change it, a changed line does).
UPSTREAM_DIGESTS: dict[str, str] = {
    # leave_group() does what it does, for the generation 0 it skips.
    "aiokafka.consumer.group_coordinator:GroupCoordinator._maybe_leave_group": "dee1cd18abe06730",
    "aiokafka.consumer.group_coordinator:GroupCoordinator._send_req": "0df8b40f9ddbc246",
    "aiokafka.consumer.group_coordinator:GroupCoordinator.reset_generation": "85a507d9c9ba0990",
    # fail_batches(): what the producer does when its sender dies; each batch's drain waiter
    # gets the error too.
    "aiokafka.producer.message_accumulator:MessageAccumulator.fail_all": "fac85443300b7eb1",
    "aiokafka.producer.message_accumulator:MessageBatch.failure": "dd2e7027b0f6c529",
    # ... and a batch sent once registers a callback removing it from the pending set, which
    # a retry's reenqueue() takes it out of: fail_batches() puts such batches back first.
    "aiokafka.producer.message_accumulator:MessageAccumulator._pop_batch": "39dc59fb5bdd5bbe",
    "aiokafka.producer.message_accumulator:MessageAccumulator.reenqueue": "46f4dcf3b72d103a",
    # (retry_count > 0: the batch was sent once, its callback registered)
    "aiokafka.producer.message_accumulator:MessageBatch.drain_ready": "2cb5a8155a09cdaa",
}

_warned: set[str] = set()  # warn_once's: an outage can repeat the same failure every second


def installed_version() -> str:
    try:
        return version("aiokafka")
    except PackageNotFoundError:
        return "not installed"


class AiokafkaPrivateApiError(RuntimeError, TrainscopeError):
    """The installed aiokafka lacks an internal that the Kafka bus relies on."""

    def __init__(self, owner: object, name: str) -> None:
        super().__init__(
            f"{type(owner).__qualname__} has no attribute {name!r}: trainscope's Kafka bus is "
            f"written for aiokafka {AIOKAFKA_VERSION}, and {installed_version()} is installed"
        )


def warn_once(error: AiokafkaPrivateApiError) -> None:
    """Log ``error`` the first time it happens in this process (at ERROR: the bus carries on
    without the call, so nothing else reports it)."""
    message = str(error)
    if message not in _warned:
        _warned.add(message)
        log.error("%s; carrying on without it", message)


def _private(owner: object, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError:
        raise AiokafkaPrivateApiError(owner, name) from None


def group_coordinator(consumer: AIOKafkaConsumer) -> Any:
    """The consumer's group coordinator (``_coordinator``); None before ``start()``."""
    return _private(consumer, "_coordinator")


def generation(coordinator: Any) -> int:
    """The coordinator's group generation (``generation``): -1 when not in a group."""
    number: int = _private(coordinator, "generation")
    return number


async def leave_group(coordinator: Any, timeout_s: float) -> None:
    """Send LeaveGroup for the coordinator's member now (``_send_req``) and forget the generation
    (``reset_generation``), as aiokafka's ``_maybe_leave_group`` does for generations above 0.
    Every attribute is looked up before anything is sent."""
    request = LeaveGroupRequest(
        _private(coordinator, "group_id"), _private(coordinator, "member_id")
    )
    send = _private(coordinator, "_send_req")
    reset_generation = _private(coordinator, "reset_generation")
    await asyncio.wait_for(send(request), timeout_s)
    reset_generation()


def fail_batches(producer: AIOKafkaProducer, error: BaseException) -> None:
    """Fail every batch the producer holds with ``error`` (its accumulator's ``fail_all``, as
    the producer does when its sender dies), and consume the error each batch's drain waiter
    then holds, which nobody awaits. Every attribute is looked up before anything is failed.

    A batch queued again for a retry (``reenqueue``: out of the pending set) still carries the
    callback its first send registered, which removes it from that set once it is done: it is
    put back in the set first, or failing it made that callback raise ``KeyError``, which
    asyncio printed as an ERROR with a traceback into the training job's log."""
    accumulator = _private(producer, "_message_accumulator")
    fail_all = _private(accumulator, "fail_all")
    queued = _private(accumulator, "_batches")
    pending = _private(accumulator, "_pending_batches")
    batches = [batch for per_partition in queued.values() for batch in per_partition]
    retried = [batch for batch in batches if _private(batch, "retry_count")]
    batches += list(pending)
    waiters = [_private(batch, "_drain_waiter") for batch in batches]
    pending.update(retried)
    fail_all(error)
    for waiter in waiters:
        if waiter.done() and not waiter.cancelled():
            waiter.exception()  # so that asyncio does not log "exception was never retrieved"


def network_client(client: Any) -> Any:
    """The ``AIOKafkaClient`` (its connections, its metadata task) of an aiokafka producer
    (``client``) or admin client (``_client``)."""
    return _private(client, "client" if isinstance(client, AIOKafkaProducer) else "_client")
