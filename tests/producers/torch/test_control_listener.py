"""The control listener's thread and the training thread: stopping it never waits out a poll."""

from __future__ import annotations

import threading

from trainscope.producers.torch.control import ControlListener
from trainscope.producers.torch.safety import Guard


class _PollThatBlocksBus:
    """A stand-in bus (passed in as a parameter) whose consumer's poll returns only when the
    test says so: a broker that answers a long poll late, which no real broker does on cue."""

    def __init__(self) -> None:
        self.polling = threading.Event()
        self.release = threading.Event()
        self.closed = threading.Event()

    def consumer(self, topics: list[str], group: str) -> _PollThatBlocksBus:
        return self

    def poll(self, timeout_s: float) -> list[object]:
        self.polling.set()
        self.release.wait()
        return []

    def commit(self) -> None:
        pass

    def close(self) -> None:
        self.closed.set()


def _polling(bus: _PollThatBlocksBus) -> tuple[ControlListener, threading.Thread]:
    """A started listener and its thread, once the thread is inside its first poll."""
    listener = ControlListener(bus_factory=lambda: bus, owns_bus=True, job_id="job", rank=0,
                               on_request=lambda request: None, guard=Guard(), not_before_ns=0)
    listener.start()
    thread = listener._thread
    assert thread is not None and bus.polling.wait(10)
    return listener, thread


def test_stop_returns_while_a_poll_is_still_out_and_the_thread_ends_after_it() -> None:
    """``detach()`` calls ``stop()`` on the training thread: it must not sit out the poll."""
    bus = _PollThatBlocksBus()
    listener, thread = _polling(bus)
    releaser = threading.Timer(1.0, bus.release.set)  # the broker answers the poll, later
    releaser.start()
    listener.stop()
    # It returned before the poll did (a stop that joined the thread returns only after it).
    assert not bus.release.is_set() and thread.is_alive()
    releaser.join()
    thread.join(10)
    assert not thread.is_alive() and bus.closed.is_set()  # it ended and closed its consumer


def test_stop_with_a_timeout_waits_for_the_thread() -> None:
    bus = _PollThatBlocksBus()
    listener, thread = _polling(bus)
    threading.Timer(0.2, bus.release.set).start()
    listener.stop(timeout_s=10)
    assert not thread.is_alive() and bus.closed.is_set()
