"""Device time of the phases (issue: GPU truth in the always-on layer), on CPU machines.

The build machines have no GPU: the device and its timing events are a **stand-in**
(``device_standin.py``), passed to ``attach(device_events=...)`` in place of
``torch.cuda.Event``. Its device runs work queued by the host on a clock of its own, as a GPU
runs launched kernels after the host has moved on; what these tests show is what the producer
does with such events: which phase each device duration lands in, which thread asks the events
anything, and how much it holds while nobody reads them.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

import pytest
import torch
from device_standin import StandInGpu
from torch_producer_helpers import by_type, read_records, steps_of, summaries_of

from trainscope.engine.windows import metric_window
from trainscope.producers.torch.device_timing import (
    DEFAULT_POOL_PAIRS,
    DEVICE_COLLECTIVE_LAYER,
    DEVICE_PHASE_LAYER,
    DeviceTimer,
)
from trainscope.producers.torch.spanlog import PhaseLog
from trainscope.schemas.metrics import PHASE_CLOCK_DEVICE
from trainscope.schemas.records import MetricSample

FORWARD_NS = 20_000_000  # the kernels each forward queues on the stand-in device
BACKWARD_NS = 5_000_000
OPTIMIZER_NS = 1_000_000
WAIT_NS = 100_000_000  # a step's all-reduce waits on the stand-in device (x its step + 1)


class _LaunchOnBackward(torch.autograd.Function):
    """Identity whose backward queues device work (the backward pass's kernels)."""

    @staticmethod
    def forward(ctx, x, gpu, duration_ns):  # type: ignore[override]
        ctx.gpu, ctx.duration_ns = gpu, duration_ns
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.gpu.launch(ctx.duration_ns)
        return grad, None, None


class StandInGpuModel(torch.nn.Module):
    """A model whose work is queued on the stand-in device; its forward returns at once."""

    def __init__(self, gpu: StandInGpu, forward_ns: int = FORWARD_NS) -> None:
        super().__init__()
        self.gpu, self.forward_ns = gpu, forward_ns
        self.first, self.second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gpu.launch(self.forward_ns)
        # In the middle: its backward runs between the first and the last gradient.
        h = _LaunchOnBackward.apply(self.first(x), self.gpu, BACKWARD_NS)
        return self.second(torch.relu(h))


def train_on_stand_in(gpu: StandInGpu, steps: int, device_runs: bool = True,
                      after_backward: Callable[[int], None] | None = None) -> None:
    model = StandInGpuModel(gpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.register_step_pre_hook(lambda *_: gpu.launch(OPTIMIZER_NS))
    for step in range(steps):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        if device_runs:
            gpu.run_queued()  # the device catches up while the host goes on


def per_call_ns(summaries: list, layer: str, name: str) -> list[float]:
    return [s.total_ns / s.count for s in summaries if (s.layer, s.name) == (layer, name)]


def test_phases_carry_their_device_time_beside_the_host_time(attach, memory_bus) -> None:
    gpu = StandInGpu()
    att = attach(window_s=0.5, device_events=gpu.event)
    train_on_stand_in(gpu, steps=30)
    time.sleep(0.6)  # a window closes while attached: its flag is sent with it
    att.detach()
    records = read_records(memory_bus)
    summaries = summaries_of(records)
    # Each phase's device time is the work it queued, exactly: not launch time, and the
    # forward's kernels are not charged to the optimizer (nor to whatever synchronised).
    assert set(per_call_ns(summaries, DEVICE_PHASE_LAYER, "forward")) == {FORWARD_NS}
    assert set(per_call_ns(summaries, DEVICE_PHASE_LAYER, "backward")) == {BACKWARD_NS}
    assert set(per_call_ns(summaries, DEVICE_PHASE_LAYER, "optimizer.step")) == {OPTIMIZER_NS}
    device_calls = sum(s.count for s in summaries if s.layer == DEVICE_PHASE_LAYER)
    assert device_calls == 3 * 30
    # The host times are still there, and measure what the host spent: far less.
    host_forward = per_call_ns(summaries, "torch_op", "forward")
    assert host_forward and max(host_forward) < FORWARD_NS / 2
    flags = [r for r in by_type(records, MetricSample) if r.name == PHASE_CLOCK_DEVICE]
    assert flags and {f.value for f in flags} == {1.0}
    stats = att.stats()
    assert stats["device_timing"] and stats["device_spans_resolved"] == 90
    assert stats["device_spans_dropped"] == 0 and stats["errors"] == 0


def test_events_are_never_synchronised_nor_read_on_the_training_thread(attach) -> None:
    gpu = StandInGpu()
    att = attach(window_s=0.5, device_events=gpu.event)
    training_thread = threading.get_ident()
    train_on_stand_in(gpu, steps=20)
    att.detach()
    counts = gpu.counts()
    assert counts["synchronize"] == 0 and counts["wait"] == 0, counts
    assert gpu.threads_of("record") == {training_thread}
    assert counts["query"] > 0 and training_thread not in gpu.threads_of("query")
    assert training_thread not in gpu.threads_of("elapsed_time")


def test_the_event_pool_is_bounded_while_no_event_completes(attach, memory_bus) -> None:
    # The device never runs (or the reader never sees it): the events stay in flight.
    gpu = StandInGpu()
    att = attach(window_s=0.5, device_events=gpu.event)
    steps = DEFAULT_POOL_PAIRS // 3 + 100  # three phases a step: more than the pool's pairs
    train_on_stand_in(gpu, steps=steps, device_runs=False)
    assert gpu.created == 2 * DEFAULT_POOL_PAIRS  # no event made past the pool's bound
    device = att.device
    assert device is not None and device.in_flight() == DEFAULT_POOL_PAIRS
    assert att.stats()["device_spans_dropped"] == 3 * steps - DEFAULT_POOL_PAIRS
    gpu.run_queued()  # the device catches up: what was in flight is filed
    att.detach()
    records = read_records(memory_bus)
    assert len(steps_of(records)) == steps  # the host's records are all there
    device_calls = sum(s.count for s in summaries_of(records) if s.layer == DEVICE_PHASE_LAYER)
    assert device_calls == DEFAULT_POOL_PAIRS


def test_nested_phases_past_the_pool_go_untimed_and_give_their_events_back() -> None:
    gpu = StandInGpu()
    timer = DeviceTimer(gpu.event, pool_pairs=1)
    log = PhaseLog(DEVICE_PHASE_LAYER, "forward")
    outer = timer.begin()
    inner = timer.begin()  # the pool's last event
    assert timer.begin() is None and timer.dropped == 1
    timer.end(log, 0, inner)  # no event left to end it: untimed, its start given back
    assert timer.dropped == 2
    timer.end(log, 0, outer)
    gpu.run_queued()
    assert timer.resolve() == 1 and timer.in_flight() == 0
    assert gpu.created == 2  # reused, never more
    with pytest.raises(ValueError, match="pool_pairs must be >= 1"):
        DeviceTimer(gpu.event, pool_pairs=0)


def test_phases_ending_out_of_order_get_their_own_end_events() -> None:
    # An asynchronous collective begun, then a phase begun and ended before the collective
    # completes (on another thread): the phase takes the end event the collective's begin
    # made; neither goes untimed while the pool is below its bound.
    gpu = StandInGpu()
    timer = DeviceTimer(gpu.event, pool_pairs=4)
    collective = timer.begin()
    phase = timer.begin()
    timer.end(PhaseLog(DEVICE_PHASE_LAYER, "optimizer.step"), 0, phase)
    timer.end(PhaseLog(DEVICE_COLLECTIVE_LAYER, "all_reduce"), 0, collective)
    gpu.run_queued()
    assert timer.dropped == 0 and timer.resolve() == 2
    assert timer.made_events() == timer.free_events() == 4


def test_a_cpu_job_sends_host_times_and_says_so(attach, memory_bus) -> None:
    from torch_producer_helpers import TinyModel, train

    att = attach(window_s=0.5)
    train(TinyModel(), steps=10)
    time.sleep(0.6)
    att.detach()
    records = read_records(memory_bus)
    assert att.stats()["device_timing"] is False
    assert not [s for s in summaries_of(records) if s.layer == DEVICE_PHASE_LAYER]
    flags = [r for r in by_type(records, MetricSample) if r.name == PHASE_CLOCK_DEVICE]
    assert flags and {f.value for f in flags} == {0.0}
    # Stamped at its window's end, as every window's sample: the engine files it with that
    # window's summaries (a stamp at the start would land in the window before, closed by then).
    window_ns = 500_000_000
    assert {metric_window(f.ts_ns, window_ns) * window_ns for f in flags} == {
        s.window_start_ns for s in summaries_of(records)}


@pytest.mark.kafka
def stand_in_all_reduce(gpu: StandInGpu, monkeypatch: pytest.MonkeyPatch
                        ) -> Callable[[int, int], None]:
    """``dist.all_reduce`` (a one-process gloo group) made to queue device work on the stand-in
    as an NCCL all-reduce's kernel does, its wait for the slowest peer; on the host it returns
    at once. Patched before ``attach``, whose wrapper then times it. Returns a call
    ``(step, wait_ns)``."""
    import torch.distributed as dist

    real = dist.all_reduce
    wait = [0]

    def all_reduce_queued_on_stand_in(tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        gpu.launch(wait[0])
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", all_reduce_queued_on_stand_in)

    def call(step: int, wait_ns: int) -> None:
        wait[0] = wait_ns
        dist.all_reduce(torch.ones(4))

    return call


def test_both_clocks_reach_the_store_through_the_real_broker_and_pipeline(
        gloo_group, attach, fresh_kafka_broker, tmp_path, monkeypatch) -> None:
    from trainscope.engine.bus_job import BusStreamJob
    from trainscope.sinks.clickhouse import ClickHouseSink, run_query
    from trainscope.transport.bus import open_bus

    gpu = StandInGpu()
    steps = 25
    all_reduce = stand_in_all_reduce(gpu, monkeypatch)
    att = attach(bus=fresh_kafka_broker.url, job_id="device-clock", window_s=0.5,
                 device_events=gpu.event)
    train_on_stand_in(gpu, steps=steps,
                      after_backward=lambda step: all_reduce(step, (step + 1) * WAIT_NS))
    att.detach()
    assert att.stats()["records_acked"] == att.stats()["records_submitted"]
    bus = open_bus(fresh_kafka_broker.url)
    sink = ClickHouseSink.open(tmp_path / "store")
    try:
        pipeline = BusStreamJob(bus, group="device-clock", detectors=[], window_s=0.5,
                                sink=sink)
        pipeline.run(idle_timeout_s=2.0, max_seconds=30)
        pipeline.finish()
        late = pipeline.engine.stats.late_events
        _, rows = run_query(sink.client, (
            "SELECT layer, name, sum(count), sum(total_ns) FROM function_summaries "
            "WHERE job_id = 'device-clock' AND name IN ('forward', 'backward', "
            "'optimizer.step') GROUP BY layer, name ORDER BY layer, name"))
        _, flags = run_query(sink.client, (
            "SELECT DISTINCT value FROM metric_samples WHERE job_id = 'device-clock' "
            f"AND name = '{PHASE_CLOCK_DEVICE}'"))
        _, step_rows = run_query(sink.client, (
            "SELECT step, collective_ns, device_collective_ns FROM step_records FINAL "
            "WHERE job_id = 'device-clock' ORDER BY step"))
        # The windows the clock samples were stored in (a sample stamped at the end of the
        # interval it describes), and those of the summaries.
        _, flag_windows = run_query(sink.client, (
            "SELECT DISTINCT intDiv(ts_ns - 1, 500000000) FROM metric_samples WHERE "
            f"job_id = 'device-clock' AND name = '{PHASE_CLOCK_DEVICE}'"))
        _, summary_windows = run_query(sink.client, (
            "SELECT DISTINCT intDiv(window_start_ns, 500000000) FROM function_summaries "
            "WHERE job_id = 'device-clock'"))
    finally:
        sink.close()
        bus.close()
    stored = {(layer, name): (int(count), int(total)) for layer, name, count, total in rows}
    assert stored[(DEVICE_PHASE_LAYER, "forward")] == (steps, steps * FORWARD_NS)
    assert stored[(DEVICE_PHASE_LAYER, "backward")] == (steps, steps * BACKWARD_NS)
    assert stored[(DEVICE_PHASE_LAYER, "optimizer.step")] == (steps, steps * OPTIMIZER_NS)
    host_count, host_total = stored[("torch_op", "forward")]
    assert host_count == steps and host_total < steps * FORWARD_NS / 2
    assert [float(v) for (v,) in flags] == [1.0]
    assert late == 0  # every window's clock sample filed with its window, none set aside
    assert {int(w) for (w,) in flag_windows} == {int(w) for (w,) in summary_windows}
    # Each step record with its all-reduce's time on both clocks: the device's, as queued.
    assert [(int(s), int(d)) for s, _, d in step_rows] == [
        (step, (step + 1) * WAIT_NS) for step in range(steps)]
    assert all(0 < int(host) < WAIT_NS for _, host, _ in step_rows), step_rows


def test_a_step_that_raises_does_not_lose_its_events(attach) -> None:
    # The script's optimizer raises now and then (a hook of its own, a NaN check): the step's
    # events must come back to the pool, or each such step would lose one for good.
    gpu = StandInGpu()
    att = attach(window_s=0.5, device_events=gpu.event)
    model = StandInGpuModel(gpu)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    calls = {"n": 0}

    def sometimes_raises(*_: object) -> None:
        calls["n"] += 1
        if calls["n"] % 2:
            raise FloatingPointError("the script's own check")

    optimizer.register_step_pre_hook(sometimes_raises)
    for _ in range(300):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1))
        optimizer.zero_grad()
        loss.backward()
        with contextlib.suppress(FloatingPointError):
            optimizer.step()
        gpu.run_queued()
    device = att.device
    assert device is not None
    device.resolve()
    assert device.in_flight() == 0
    # One optimizer start may be waiting for its step's end; nothing else is missing (the
    # phases the pool could not time while the sender thread was between rounds are counted
    # as dropped, and their events were never taken).
    assert device.free_events() >= device.made_events() - 1, device.free_events()


def test_asynchronous_collectives_and_ddp_buckets_are_timed_on_the_device(
        gloo_group, attach, memory_bus) -> None:
    """DDP's bucket all-reduces and ``async_op=True`` calls: a start event at the call, an end
    event in the work's completion callback (on a CUDA job, torch runs it on streams that
    follow the collective's kernels), never a synchronising call, every event back in the
    pool. The stand-in device cannot show what NCCL's streams do on a GPU; it shows that each
    such collective gets its device time beside its host time."""
    import torch.distributed as dist

    gpu = StandInGpu()
    att = attach(window_s=0.5, device_events=gpu.event)
    model = torch.nn.parallel.DistributedDataParallel(StandInGpuModel(gpu))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 12
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dist.all_reduce(torch.ones(4), async_op=True).wait()
        gpu.run_queued()
    device = att.device
    assert device is not None
    deadline = time.monotonic() + 5
    while device.in_flight() and time.monotonic() < deadline:
        device.resolve()
        time.sleep(0.05)
    att.detach()
    summaries = summaries_of(read_records(memory_bus))

    def count(layer: str, name: str) -> int:
        return sum(s.count for s in summaries if (s.layer, s.name) == (layer, name))

    buckets = count("collective", "ddp_allreduce")
    assert buckets >= steps
    assert count(DEVICE_COLLECTIVE_LAYER, "ddp_allreduce") == buckets, att.stats()
    assert count("collective", "all_reduce") == steps
    assert count(DEVICE_COLLECTIVE_LAYER, "all_reduce") == steps
    # The device times lie within what the device ran: never negative, never past the whole.
    device_ns = [s.total_ns for s in summaries if s.layer == DEVICE_COLLECTIVE_LAYER]
    assert all(0 <= ns <= gpu.done_ns for ns in device_ns), device_ns
    counts = gpu.counts()
    assert counts["synchronize"] == 0 and counts["wait"] == 0, counts
    assert device.in_flight() == 0 and device.free_events() == device.made_events()
    assert att.stats()["errors"] == 0




def test_each_step_record_carries_its_collectives_device_time(
        gloo_group, attach, memory_bus, monkeypatch) -> None:
    """The step record's ``device_collective_ns``: what the early flag reads on a CUDA job.
    The stand-in collective queues device work as an NCCL all-reduce's kernel does (its wait
    for the slowest peer); on the host it returns at once. Step ``i`` waits ``i + 1`` ms on the
    device, so a device time filed under the wrong step shows. A step whose collective has not
    run on the device yet is held back, and sent once it has."""
    gpu = StandInGpu()
    all_reduce = stand_in_all_reduce(gpu, monkeypatch)
    att = attach(window_s=0.5, device_events=gpu.event)
    model = StandInGpuModel(gpu, forward_ns=2_000_000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int, device_runs: bool) -> None:
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 1))
        optimizer.zero_grad()
        loss.backward()
        all_reduce(i, (i + 1) * WAIT_NS)
        optimizer.step()  # the step ends here: the all-reduce was step i's
        if device_runs:
            gpu.run_queued()

    for i in range(10):
        step(i, device_runs=True)
    for i in range(10, 13):
        step(i, device_runs=False)  # the device falls behind: three steps not run yet
    time.sleep(1.2)  # two sender rounds
    sent_before = sorted(s.step for s in steps_of(read_records(memory_bus, group="early")))
    gpu.run_queued()
    time.sleep(1.2)
    att.detach()
    steps = sorted(steps_of(read_records(memory_bus)), key=lambda s: s.step)
    assert sent_before == list(range(10)), sent_before
    assert [s.step for s in steps] == list(range(13))
    assert [s.device_collective_ns for s in steps] == [(i + 1) * WAIT_NS for i in range(13)]
    # On the host the same all-reduce took next to nothing: the host clock cannot tell them
    # apart (NCCL's is launch time).
    assert all(0 < s.collective_ns < WAIT_NS for s in steps), [s.collective_ns for s in steps]
    stats = att.stats()
    assert stats["device_steps_unsettled"] == 0 and stats["errors"] == 0, stats
    assert gpu.counts()["synchronize"] == 0 and gpu.counts()["wait"] == 0


def test_a_step_held_past_its_bound_goes_with_what_resolved_and_is_counted() -> None:
    """A GPU that never catches up (hung, or a reader far behind): the step's record is not
    held for ever; it goes after the hold with the collectives that did resolve, counted as
    unsettled, and the late ones are not added to a later step."""
    from trainscope.producers.torch.steps import DEVICE_HOLD_MIN_S, StepTracker

    gpu = StandInGpu()
    device = DeviceTimer(gpu.event)
    tracker = StepTracker("j", 0)
    log = device.log(DEVICE_COLLECTIVE_LAYER, "all_reduce")

    def collective(step: int, wait_ns: int) -> None:
        start = device.begin_collective(step)
        gpu.launch(wait_ns)
        device.end(log, 0, start, step)

    collective(0, 2 * WAIT_NS)
    collective(0, 3 * WAIT_NS)
    gpu.run_queued()  # step 0's both ran
    collective(0, 4 * WAIT_NS)  # ... and a third that will not, before the hold ends
    end_ns = 10**12
    tracker.end(end_ns)
    collective(1, 5 * WAIT_NS)
    tracker.end(end_ns + 10**6)
    device.resolve()
    assert tracker.drain(device, end_ns + 10**6) == []  # held: step 0 still runs on device
    assert device.steps_in_flight() == 2
    late_ns = end_ns + int(DEVICE_HOLD_MIN_S * 1e9) + 1
    (batch,) = tracker.drain(device, late_ns)
    assert batch.column("step").tolist() == [0]
    assert batch.column("device_collective_ns").tolist() == [5 * WAIT_NS]
    assert tracker.device_steps_unsettled == 1
    gpu.run_queued()
    device.resolve()
    (batch,) = tracker.drain(device, late_ns)
    # Step 1 has its own collective's time, not step 0's late one.
    assert batch.column("step").tolist() == [1]
    assert batch.column("device_collective_ns").tolist() == [5 * WAIT_NS]
    assert device.steps_in_flight() == 0 and tracker.device_steps_unsettled == 1


def test_a_stall_inside_a_collective_on_the_device_is_reported_as_waiting() -> None:
    """A hung NCCL job: the host's call returned at once, so on the host nobody waits. The
    stall report's ``collective_wait_s`` then comes from the device: a rank whose device is
    inside a collective (its start event completed, its end not) has waited since the host
    issued it; a rank whose device has not reached its collective (the one stuck in its own
    work, whom the others wait for) is not waiting."""
    from trainscope.producers.torch.steps import StepTracker

    ms = 1_000_000
    reports = {}
    for case in ("inside the collective", "before the collective"):
        gpu = StandInGpu()
        device = DeviceTimer(gpu.event)
        tracker = StepTracker("j", 0)
        tracker.activity(0)
        for step in range(10):
            tracker.end((step + 1) * 10 * ms)
        tracker.drain(device, 100 * ms)
        start_ns = tracker.start_ns
        gpu.launch(5 * ms)  # the step's own work
        issued_ns = start_ns + 1_000 * ms
        event = device.begin_collective(tracker.step)
        gpu.launch(WAIT_NS)  # the all-reduce's kernel, waiting for a peer that never comes
        device.end(device.log(DEVICE_COLLECTIVE_LAYER, "all_reduce"), issued_ns, event,
                   tracker.step)
        gpu.run_to(5 * ms + (WAIT_NS // 2 if case == "inside the collective" else 0) - 1)
        assert not tracker.pending  # the host's call returned
        reports[case] = {s.name: s.value for s in
                         tracker.stall_report(start_ns + 4_000 * ms, "h", device)}
        assert tracker.stall_report(start_ns + 4_000 * ms, "h")[1].value == 0.0  # host only
    assert reports == {"inside the collective": {"step_open_s": 4.0, "collective_wait_s": 3.0},
                       "before the collective": {"step_open_s": 4.0, "collective_wait_s": 0.0}}
