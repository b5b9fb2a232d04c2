"""Every error trainscope raises on purpose shares one root and keeps its built-in base."""

from __future__ import annotations

import importlib

import pytest

from trainscope.schemas.errors import TrainscopeError

ERRORS = [
    ("trainscope.schemas.codec", "BadMessage", ValueError),
    ("trainscope.transport.bus", "BusError", RuntimeError),
    ("trainscope.store.client", "StoreError", RuntimeError),
    ("trainscope.producers.simulate.faults", "FaultSpecError", ValueError),
    ("trainscope.producers.agent.base", "CollectorUnavailable", RuntimeError),
    ("trainscope.producers.replay.kineto", "KinetoError", ValueError),
    ("trainscope.schemas.optrace", "TraceError", ValueError),
    ("trainscope.detectors.registry", "UnknownDetector", LookupError),
]


@pytest.mark.parametrize(("module", "name", "builtin"), ERRORS)
def test_error_derives_from_the_root_and_its_builtin(
    module: str, name: str, builtin: type[Exception]
) -> None:
    error = getattr(importlib.import_module(module), name)
    assert issubclass(error, TrainscopeError)
    assert issubclass(error, builtin)
    args = ("kind", "why") if name == "CollectorUnavailable" else ("why",)
    with pytest.raises(TrainscopeError, match="why"):
        raise error(*args)
