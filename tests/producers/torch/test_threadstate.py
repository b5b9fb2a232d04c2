"""Each thread state our callbacks run in is kept once, even on a thread whose id was reused.

The call that keeps a state (``PyGILState_Ensure``) is replaced by a counter here: on threads
Python started, the interpreter deletes the state at the thread's end whatever its count, so the
real effect shows only on a backend's threads (see test_torch_profile_under_ddp.py).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from trainscope.producers.torch import threadstate


@pytest.fixture()
def ensure_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    counter = SimpleNamespace(pythonapi=SimpleNamespace(
        PyGILState_Ensure=lambda: calls.append(threading.get_ident())))
    monkeypatch.setattr(threadstate, "ctypes", counter)
    return calls


def _run(times: int) -> int:
    ident: list[int] = []

    def callback() -> None:
        for _ in range(times):
            threadstate.keep_thread_state()
        ident.append(threading.get_ident())

    thread = threading.Thread(target=callback)
    thread.start()
    thread.join()
    return ident[0]


def test_a_thread_keeps_its_state_once_however_often_it_asks(ensure_calls: list[int]) -> None:
    _run(times=50)
    assert len(ensure_calls) == 1


def test_a_new_thread_with_a_reused_id_keeps_its_own_state(ensure_calls: list[int]) -> None:
    idents = [_run(times=3) for _ in range(20)]  # one after another: ids come back
    assert len(set(idents)) < len(idents), "no id was reused: the case is not exercised"
    assert len(ensure_calls) == 20
