"""Safety: nothing raises into training, full queues drop and count, a lost bus is survived."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch_producer_helpers import TinyModel, read_records, steps_of, train

from trainscope.producers.torch.control import wait_until
from trainscope.transport.bus import BusError
from trainscope.transport.memory import MemoryBus


class FlakyBus(MemoryBus):
    """A bus that refuses everything while ``down`` is set, like a stopped broker."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        if self.down.is_set():
            raise BusError("broker unreachable (test)")
        super().publish(topic, value, key)


class BrokenLog(list):
    """A phase log's list whose every append raises, as a bug inside trainscope would."""

    def append(self, value: int) -> None:
        raise ZeroDivisionError("bug inside trainscope")


def test_a_failing_hook_is_counted_and_logged_once_but_never_raises(
    attach, monkeypatch, caplog
) -> None:
    att = attach()

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("bug inside trainscope")

    monkeypatch.setattr(att.recorder, "add", broken)
    for phase in att.phase_logs:  # the per-step hooks' own path, on the training thread
        monkeypatch.setattr(phase, "values", BrokenLog())
    with caplog.at_level(logging.WARNING, logger="trainscope"):
        train(TinyModel(), steps=8)  # must not raise
    stats = att.stats()
    assert stats["steps"] == 8
    # forward, backward, optimizer, data loader: each fails every step.
    assert stats["errors"] >= 8 * 4
    assert {"forward hook", "optimizer hook", "dataloader hook"} <= set(stats["errors_by_kind"])
    # The first steps time backward exactly (through the recorder), the later ones through
    # the parameters' hooks (through the backward log): both fail, both are caught.
    assert {"record", "backward hook"} <= set(stats["errors_by_kind"])
    assert att.model_hooks.backward.mode == "parameters"
    warnings = [r for r in caplog.records if "ZeroDivisionError" in r.getMessage()]
    kinds = {r.getMessage().split(" failed")[0] for r in warnings}
    assert len(warnings) == len(kinds)  # once per kind, not once per failure


def test_a_hook_module_that_cannot_load_is_counted_and_the_others_work(
        attach, memory_bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """One of our hook modules failing at import (a bug of ours, a torch without what it
    needs) stops neither attach() nor training: that hook is counted, the others time."""
    import trainscope.producers.torch as package

    monkeypatch.delattr(package, "scaler", raising=False)
    monkeypatch.setitem(sys.modules, "trainscope.producers.torch.scaler", None)
    att = attach()
    train(TinyModel(), steps=4)
    stats = att.stats()
    att.detach()
    assert stats["errors_by_kind"] == {"grad scaler hook": 1}, stats["errors_by_kind"]
    assert len(steps_of(read_records(memory_bus))) == 4


def test_a_full_queue_drops_and_counts_instead_of_blocking(attach) -> None:
    bus = FlakyBus()
    bus.down.set()
    att = attach(bus=bus, queue_size=5)
    train(TinyModel(), steps=20)
    # Step records are built and offered by the sender thread, within a round of it.
    assert wait_until(lambda: att.stats()["records_dropped"] >= 20 + 1 - 5, timeout_s=10), (
        att.stats())  # steps + topology, at most 5 held
    stats = att.stats()
    assert stats["steps"] == 20
    assert stats["records_queued"] <= 5
    assert stats["records_sent"] == 0


def test_sending_resumes_after_the_bus_comes_back(attach) -> None:
    bus = FlakyBus()
    att = attach(bus=bus, window_s=0.2)
    att.sender.backoff_initial_s = att.sender._backoff_s = 0.05
    att.sender.flush_interval_s = 0.05
    train(TinyModel(), steps=3)
    assert wait_until(lambda: att.stats()["records_sent"] >= 4, timeout_s=10)
    bus.down.set()
    train(TinyModel(), steps=3)
    assert wait_until(lambda: att.stats()["bus_errors"] >= 1, timeout_s=10)
    assert not att.stats()["bus_up"]
    bus.down.clear()
    train(TinyModel(), steps=3)
    assert wait_until(lambda: att.stats()["bus_up"] and att.stats()["records_queued"] == 0,
                      timeout_s=10)
    att.detach()
    steps = steps_of(read_records(bus))
    # Nothing was dropped (the queue was large enough), so every step arrived, in order.
    assert att.stats()["records_dropped"] == 0
    assert sorted({r.step for r in steps}) == list(range(9))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_records_nothing_and_the_parent_goes_on(attach) -> None:
    att = attach()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the attachment is switched off, hooks are harmless no-ops
        ok = not att.active and att.sender._thread is None
        train(TinyModel(), steps=2)
        ok = ok and att.recorder._open == {}
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1" and status == 0
    os.close(read)
    train(TinyModel(), steps=2)
    assert att.active and att.stats()["steps"] == 2


def test_a_data_loader_with_forked_workers_trains_normally(attach, memory_bus) -> None:
    att = attach()
    data = torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, num_workers=2, multiprocessing_context="fork"
    )
    train(TinyModel(), steps=4, loader=loader)
    att.detach()
    assert att.stats()["errors"] == 0
    assert len(steps_of(read_records(memory_bus))) == 4


# Run as its own process: with the bug this test guards against, the process deadlocks.
_COLLECT_EVERYWHERE = """
import gc, json, sys
sys.path.insert(0, sys.argv[1])
from torch_producer_helpers import TinyModel, read_records, summaries_of, train
import trainscope
from trainscope.transport.memory import MemoryBus

bus = MemoryBus()
att = trainscope.attach(bus=bus, job_id="collect-everywhere", window_s=0.1)
gc.set_threshold(1)  # a collection at nearly every allocation, ours under our locks included
train(TinyModel(), steps=300)
gc.set_threshold(700)
att.detach()
pauses = [s for s in summaries_of(read_records(bus)) if s.layer == "gc"]
sys.stdout.write(json.dumps({"steps": att.stats()["steps"], "errors": att.stats()["errors"],
                             "gc_pauses": sum(s.count for s in pauses)}) + "\\n")
"""


def test_a_collection_started_inside_our_own_locks_is_timed_not_deadlocked() -> None:
    """A GC callback runs inside whatever allocation started the collection: with one made
    while the sender held the recorder's lock, recording the pause waited on that lock forever
    (a DDP rank stopped, and its peers in the next all-reduce). With a collection at nearly
    every allocation, 300 steps train, with the sender condensing 100 ms windows meanwhile, and
    the pauses are counted."""
    helpers = str(Path(__file__).parent)
    try:
        result = subprocess.run([sys.executable, "-c", _COLLECT_EVERYWHERE, helpers],
                                capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the training process deadlocked (no exit in 120 s): {exc.stderr!r}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["steps"] == 300 and report["errors"] == 0, report
    assert report["gc_pauses"] > 300, report
