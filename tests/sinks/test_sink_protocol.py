"""The ClickHouse writer is a :class:`~trainscope.engine.sink.Sink`: it has every method the
stream jobs call, with the same parameters (the engine calls them without probing)."""

from __future__ import annotations

import inspect

from trainscope.engine.sink import Sink
from trainscope.sinks.clickhouse import ClickHouseSink


def test_clickhouse_sink_has_every_method_of_the_protocol() -> None:
    wanted = [name for name, _ in inspect.getmembers(Sink, inspect.isfunction)
              if not name.startswith("_")]
    assert wanted
    for name in wanted:
        got = inspect.signature(getattr(ClickHouseSink, name))
        assert list(got.parameters) == list(inspect.signature(getattr(Sink, name)).parameters)
