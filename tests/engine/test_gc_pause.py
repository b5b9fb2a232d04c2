"""The cycle collector is paused while the stream job takes in a poll, and only then."""

from __future__ import annotations

import gc

import pytest

from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.engine.gc_pause import collector_paused
from trainscope.schemas.codec import encode_stamped
from trainscope.schemas.records import StepBatch, StepRecord
from trainscope.transport.bus import Message


@pytest.fixture(autouse=True)
def collector_enabled() -> object:
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_inside_and_resumed_after_even_on_error() -> None:
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("the block failed")
    assert gc.isenabled()


def test_left_disabled_when_the_caller_disabled_it() -> None:
    gc.disable()
    with collector_paused():
        with collector_paused():  # nested: the outer pause resumes, not the inner one
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_poll_runs_paused_and_leaves_the_collector_as_it_found_it() -> None:
    seen: list[bool] = []

    class Job(EmbeddedStreamJob):
        def dead_letter(self, message: Message, error: str) -> None:
            seen.append(gc.isenabled())  # called from inside the poll's processing

    job = Job(window_s=2.0)
    steps = [StepRecord(job_id="j", rank=0, step=1, start_ns=1_700_000_000 * 10**9,
                        duration_ns=10**6)]
    messages = [Message("events", 0, 0, None, b"not a batch"),
                Message("events", 0, 1, None, encode_stamped([StepBatch.from_records(steps)],
                                                             7, 1))]
    job.process_messages(messages)
    assert seen == [False]
    assert gc.isenabled()
    assert job.stats().decode.rejected == 1 and job.stats().decode.emitted == 1
