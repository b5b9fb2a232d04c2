"""faust-streaming's private API as trainscope uses it is still there, and still the same.

The rebalance-safe consumer copies, replaces or relies on Faust functions that Faust may change
in any release; ``faust_private`` records each one's source digest and holds every access to a
private name. These tests fail, naming what changed or is missing and the installed version,
when the installed faust-streaming is not the one the adapter was written for.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import faust
import pytest
from faust.exceptions import NotReady
from faust.transport.consumer import Fetcher
from faust.transport.drivers.aiokafka import Consumer as FaustConsumer
from faust.types import TP
from upstream_source import changed_functions, report, source_digest, upstream_source

from trainscope.engines.faust import faust_private
from trainscope.engines.faust.consumer import RebalanceSafeConsumer, use_rebalance_safe_consumer
from trainscope.engines.faust.faust_private import FaustPrivateApiError, PrivateHooks

ADAPTER = "trainscope/engines/faust/faust_private.py"
# Faust's methods that our consumer overrides on purpose; any other name of ours must be new.
OVERRIDES = {*faust_private.HOOKS, "ack", "seek", "perform_seek", "on_partitions_revoked"}
TP0 = TP("trainscope.test", 0)


def test_upstream_functions_are_as_recorded() -> None:
    changed = changed_functions(faust_private.UPSTREAM_DIGESTS)
    assert not changed, report(
        "faust-streaming",
        faust_private.FAUST_VERSION,
        faust_private.installed_version(),
        ADAPTER,
        changed,
    )


def test_a_changed_upstream_function_is_named() -> None:
    name = "faust.transport.consumer:Consumer._new_offset"
    recorded = {name: faust_private.UPSTREAM_DIGESTS[name]}
    source = upstream_source(name)
    assert changed_functions(recorded, lambda _: source + "    # a comment\n") == []
    modified = source.replace("return batch[-1] + 1", "return batch[-1] + 2")
    assert modified != source
    changed = changed_functions(recorded, lambda _: modified)
    assert changed == [
        f"{name}: digest now {source_digest(modified)!r}, recorded {recorded[name]!r}"
    ]
    text = report("faust-streaming", "0.15.3", "0.16.0", ADAPTER, changed)
    assert name in text and "0.16.0 is installed" in text


def test_a_function_gone_from_its_class_is_named() -> None:
    name = "faust.transport.consumer:Consumer._no_such_method"
    assert changed_functions({name: "0" * 16}) == [
        f"{name}: not found (KeyError: '_no_such_method')"
    ]


def _faust_objects(**overrides: Any) -> tuple[Any, Any, Any]:
    """A real worker's consumer (ours), its fetcher and its producer, built without a broker."""

    async def build() -> tuple[Any, Any, Any]:
        app = faust.App("trainscope-test-private", broker="kafka://127.0.0.1:1",
                        store="memory://", web_enabled=False, **overrides)
        use_rebalance_safe_consumer(app)
        return app.consumer, Fetcher(app), app.producer

    return asyncio.run(build())


def test_every_private_name_exists_on_real_objects() -> None:
    consumer, fetcher, producer = _faust_objects(broker_commit_every=2)
    assert isinstance(consumer, RebalanceSafeConsumer)  # its __init__ checked the attributes
    exercised = {
        "installed_version": lambda: faust_private.installed_version() == "0.15.3",
        "read_offsets": lambda: faust_private.read_offsets(consumer)[TP0] is None,
        "committed_offset": lambda: faust_private.committed_offset(consumer, TP0) is None,
        "acknowledged": lambda: faust_private.acknowledged(consumer, TP0) == ([], set()),
        "commit_every": lambda: faust_private.commit_every(consumer) == 2,
        "take_commit_due": lambda: faust_private.take_commit_due(consumer, 2) is False,
        "stop_requested": lambda: not (
            faust_private.stop_requested(consumer)() or faust_private.stop_requested(fetcher)()
        ),
    }
    for name, check in exercised.items():
        assert check(), name
    with pytest.raises(NotReady):  # Faust's own answer before the app starts: the method exists
        faust_private.aiokafka_producer(producer)
    exercised["aiokafka_producer"] = lambda: True
    functions = {
        name
        for name, function in inspect.getmembers(faust_private, inspect.isfunction)
        if function.__module__ == faust_private.__name__ and not name.startswith("_")
    }
    assert functions == set(exercised), "every adapter function is tried on a real object"


def test_the_hooks_reach_our_methods() -> None:
    consumer, _, _ = _faust_objects()
    acked, acked_index = faust_private.acknowledged(consumer, TP0)
    acked.extend([0, 1, 3])
    acked_index.update([0, 1, 3])
    consumer._first_read[TP0] = 0
    # What Faust's committer calls: our rule (0 and 1 committed, 3 waits for 2).
    assert consumer._new_offset(TP0) == 2
    assert acked == [3]


def test_a_missing_attribute_is_named_with_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faust_private, "CONSUMER_ATTRIBUTES", ("_read_offset", "_gone"))
    with pytest.raises(FaustPrivateApiError, match=r"'_gone'.*faust-streaming 0\.15\.3"):
        _faust_objects()
    monkeypatch.setattr(faust_private, "HOOKS", ("_drain_messages", "_gone_hook"))
    with pytest.raises(FaustPrivateApiError, match=r"Consumer has no attribute '_gone_hook'"):
        _faust_objects()
    with pytest.raises(FaustPrivateApiError, match=r"object has no attribute '_committed_offset'"):
        faust_private.committed_offset(object(), TP0)  # type: ignore[arg-type]


def test_our_names_do_not_shadow_faust_names() -> None:
    # A name of ours that Faust also uses would silently replace its attribute or method.
    consumer, _, _ = _faust_objects()
    class Bare(FaustConsumer):  # what the metaclasses give every subclass (logger, ...)
        pass

    mine = {n for cls in (RebalanceSafeConsumer, PrivateHooks) for n in vars(cls)}
    mine = {n for n in mine if not n.startswith("__")} - set(vars(Bare)) - OVERRIDES
    mine |= set(vars(consumer)) - set(vars(_plain_faust_consumer()))
    shadowed = sorted(n for n in mine if hasattr(FaustConsumer, n))
    assert not shadowed, f"names of ours that faust-streaming's Consumer also has: {shadowed}"
    assert all(hasattr(FaustConsumer, n) for n in OVERRIDES)


def _plain_faust_consumer() -> Any:
    async def build() -> Any:
        app = faust.App("trainscope-test-plain", broker="kafka://127.0.0.1:1",
                        store="memory://", web_enabled=False)
        return app.consumer

    return asyncio.run(build())
