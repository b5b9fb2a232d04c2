"""The attachment: one per process, owns the hooks, the recorder and the sender.

``attach()`` builds it, installs the hooks and returns it as the user's handle
(``.stats()``, ``.detach()``). Hook bodies call its ``record``/``on_*`` methods; everything they
do is cheap on the training thread and guarded against raising.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from trainscope.config.secrets import redact_url
from trainscope.producers.torch.device_timing import DeviceTimer, EventFactory, cuda_events
from trainscope.producers.torch.options import Options
from trainscope.producers.torch.safety import Guard, log
from trainscope.producers.torch.schedstat import RunQueueClock
from trainscope.producers.torch.sender import Sender
from trainscope.producers.torch.spanlog import PhaseLog
from trainscope.producers.torch.steps import StepTracker
from trainscope.schemas.metrics import PHASE_CLOCK_DEVICE
from trainscope.schemas.recorder import WindowRecorder
from trainscope.schemas.records import ControlMessage, MetricSample, Topology, WorkerInfo
from trainscope.transport.bus import Bus, open_bus, rank_key
from trainscope.transport.security import parse_kafka_url

FULL_LAYOUT_MAX_RANKS = 4096


class Attachment:
    """The PyTorch producer inside one training process: what ``attach()`` returns.

    It owns the installed hooks (and their removal), the :class:`WindowRecorder` that condenses
    spans per epoch-aligned window, the step tracker, the :class:`Sender` (this rank's outbox
    and its thread), the control listener that turns on profiling on request, the profiler
    controller and the guard that counts whatever failed inside trainscope. The training thread
    only appends to the recorder, the phase and step logs and the sender's queue; ``stats()``
    and ``detach()`` are the user's handle.
    """

    def __init__(self, options: Options, bus: Bus | str | None = None,
                 device_events: EventFactory | None = None) -> None:
        self.options = options
        self.guard = Guard()
        self.active = True
        self._pid = os.getpid()
        self.recorder = WindowRecorder.for_window(options.window_s)
        self.steps = StepTracker(options.job_id, options.rank)
        # The per-step phases, appended by the hooks and drained by the sender thread.
        self.forward_log = PhaseLog("torch_op", "forward")
        self.backward_log = PhaseLog("torch_op", "backward")
        self.optimizer_log = PhaseLog("torch_op", "optimizer.step")
        self.dataloader_log = PhaseLog("dataloader", "next_batch")
        # GC pauses too, and for a second reason: see hooks.install_gc_hook.
        self.gc_log = PhaseLog("gc", "gc.collect")
        self.phase_logs = (
            self.forward_log, self.backward_log, self.optimizer_log, self.dataloader_log,
            self.gc_log,
        )
        # Device time of the phases (producers/torch/device_timing.py): from the start with
        # the event type given, else from the first forward whose input is on a CUDA device.
        self.device: DeviceTimer | None = (
            DeviceTimer(device_events) if device_events is not None else None)
        self._device_checked = device_events is not None
        self._clock_flagged_ns = -1  # the last window whose clock was said (PHASE_CLOCK_DEVICE)
        # This process's wait for a CPU, read by the sender thread (producers/torch/schedstat.py).
        self.runqueue = RunQueueClock()
        self.bus_url, factory, owns = _bus_factory(bus if bus is not None else options.bus_url)
        self._bus_factory = factory
        self._owns_bus = owns
        self.sender = Sender(
            bus_factory=factory,
            owns_bus=owns,
            key=rank_key(options.job_id, options.rank),
            guard=self.guard,
            capacity=options.queue_size,
            producers=[self._closed_windows],
        )
        from trainscope.producers.torch.profiling import ProfileController

        self.profiler = ProfileController(
            self, options.profile_budget_s, options.profile_max_steps
        )
        self.control: Any = None
        self.optrace: Any = None
        self.original_all_reduce: Callable[..., Any] | None = None
        # Set by api.attach() to forget this attachment on detach: a callback, because api
        # imports this module and an import back would close a cycle.
        self.on_detach: Callable[[Attachment], None] | None = None
        self._uninstall: list[Callable[[], None]] = []
        self._ddp_seen: set[int] = set()
        self.attached_ns = time.time_ns()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        # Each hook's module is imported by its own installer: one that cannot load (our bug,
        # or a torch that lacks what it needs) is reported and counted, and training goes on
        # with the others.
        installers: list[tuple[str, str, str]] = [  # kind, module, its installer
            ("optimizer hooks", "hooks", "install_optimizer_hooks"),
            ("dataloader hook", "hooks", "install_dataloader_hook"),
            ("grad scaler hook", "scaler", "install_grad_scaler_hook"),
            ("gc hook", "hooks", "install_gc_hook"),
            ("collective hooks", "collectives", "install_collective_hooks"),
            ("functional collective hooks", "functional_collectives",
             "install_functional_collective_hooks"),
        ]
        try:
            self._uninstall.append(self._install_model_hooks())
        except Exception as exc:
            self.guard.report("model hooks", exc)
        for kind, module, installer in installers:
            try:
                self._uninstall.append(getattr(_hook_module(module), installer)(self))
            except Exception as exc:
                self.guard.report(kind, exc)
        if self.options.optrace:
            from trainscope.producers.torch.optrace import OpTraceRecorder

            self.optrace = OpTraceRecorder(self)
        if self._bus_factory is None:
            log.warning(
                "trainscope: no bus configured (argument bus= or env TRAINSCOPE_BUS); "
                "measurements are condensed in this process and nothing is sent"
            )
        else:
            self._start_control()
        # Without a bus the sender still condenses (and discards) closed windows, so memory
        # stays bounded however long the job runs.
        self.sender.start()
        self.submit(self._topology())

    def _install_model_hooks(self) -> Callable[[], None]:
        self.model_hooks = _hook_module("hooks").ModelHooks(self)
        return self.model_hooks.install()

    def _start_control(self) -> None:
        from trainscope.producers.torch.control import ControlListener

        assert self._bus_factory is not None
        self.control = ControlListener(
            bus_factory=self._bus_factory,
            owns_bus=self._owns_bus,
            job_id=self.options.job_id,
            rank=self.options.rank,
            on_request=self._on_control,
            guard=self.guard,
            not_before_ns=self.attached_ns - 5_000_000_000,
        )
        self.control.start()

    def detach(self, timeout_s: float = 5.0) -> None:
        """Remove every hook, send what is left (up to ``timeout_s``) and stop the threads."""
        if not self.active:
            return
        self.active = False
        for uninstall in reversed(self._uninstall):
            try:
                uninstall()
            except Exception as exc:
                self.guard.report("detach", exc)
        self._uninstall = []
        self.profiler.abort()
        if self.optrace is not None:
            try:
                self.optrace.flush()
            except Exception as exc:
                self.guard.report("op trace", exc)
        if self.control is not None:
            self.control.stop()
        self.sender.stop(timeout_s)
        if self.on_detach is not None:
            self.on_detach(self)

    def after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) records nothing and owns no threads."""
        self.active = False
        self.guard.reset_after_fork()
        self.recorder.reset_after_fork()
        for phase in self.phase_logs:
            phase.clear()
        self.steps.log.clear()
        self.runqueue.disable()
        self.device, self._device_checked = None, True  # CUDA does not survive a fork
        self.sender.reset_after_fork()
        self.control = None

    # -- what hooks call ----------------------------------------------------------------------
    def record(
        self, layer: str, name: str, start_ns: int, duration_ns: int, bytes_moved: int = 0
    ) -> None:
        if self.active:
            # Guarded here as well as in each hook, so a failure to record one span never
            # skips the rest of a hook (e.g. the step boundary after optimizer.step).
            try:
                self.recorder.add(layer, name, start_ns, duration_ns, bytes_moved)
            except Exception as exc:
                self.guard.report("record", exc)

    def record_collective(self, name: str, start_ns: int, duration_ns: int,
                          bytes_moved: int) -> None:
        """A collective's span, and its time added to the step's (how long this rank waited:
        the rank its peers wait on waits least)."""
        self.record("collective", name, start_ns, duration_ns, bytes_moved)
        self.steps.collective_ns += duration_ns

    def submit(self, record: Any) -> None:
        if self.active:
            self.sender.submit(record)

    def on_forward_begin(self, module: Any) -> None:
        key = id(module)
        if key in self._ddp_seen:
            return
        self._ddp_seen.add(key)
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(module, DistributedDataParallel):
            from trainscope.producers.torch.collectives import install_ddp_comm_hook

            install_ddp_comm_hook(self, module)

    def on_forward_end(self, start_ns: int, end_ns: int) -> None:
        if self.optrace is not None:
            self.optrace.add("forward-compute", start_ns, end_ns)

    def on_backward_end(self, start_ns: int, end_ns: int) -> None:
        if self.optrace is not None:
            self.optrace.add("backward-compute", start_ns, end_ns)

    def on_ddp_allreduce(self, start_ns: int, end_ns: int) -> None:
        if self.optrace is not None:
            self.optrace.add("separate-grads-all-reduce", start_ns, end_ns)

    def begin_explicit_step(self) -> None:
        if not self.steps.explicit:
            self.steps.explicit = True
        if not self.steps.start_ns:  # the first step starts here
            now_ns = time.time_ns()
            self.steps.activity(now_ns)
            self.recorder.step_started(now_ns)

    def end_step(self, now_ns: int, samples: int | None = None, tokens: int | None = None) -> None:
        """The step boundary (training thread): at the pacing optimizer's step or the end of
        an explicit step.

        Once settled, every step comes here, so the usual case is tests of attributes rather
        than calls (each Python call costs about 1 µs per step in a real loop): the recorder's
        step start, the model hooks' and the profiler's step-end work are inlined or skipped
        when there is none (``ModelHooks.quiet_at_step_end`` states the hooks' test).
        """
        if not self.active:
            return
        steps = self.steps
        step = steps.end(now_ns, samples, tokens)  # its record is built by the sender
        starts = self.recorder.step_starts  # the next step's spans go to its window
        if not starts or now_ns >= starts[-1]:
            starts.append(now_ns)
        if not step & 1023:
            steps.log.bound()
            for phase in self.phase_logs:
                phase.bound()
        if self.optrace is not None:
            try:
                self.optrace.end_step(step)
            except Exception as exc:
                self.guard.report("op trace", exc)
        hooks = self.model_hooks
        backward = hooks.backward
        if (hooks.forwards_in_step and not hooks.global_handles and backward.settled
                and not backward.pass_open and not backward.missed):
            hooks.forwards_in_step = 0
        else:
            hooks.on_step_end()
        profiler = self.profiler
        if profiler.session is not None or profiler.pending is not None:
            profiler.on_step_end(now_ns)

    # -- sender thread ------------------------------------------------------------------------
    def _closed_windows(self, final: bool) -> list[Any]:
        recorder = self.recorder
        device = self.device
        if device is not None:
            device.resolve()  # first: the step records wait for their collectives' device time
        out: list[Any] = self.steps.drain(device, time.time_ns(), final)
        for phase in self.phase_logs:
            phase.drain_into(recorder)
        if device is not None:
            device.drain_into(recorder)
        if self.active:
            self.runqueue.sample_into(recorder, self.steps.step)
            now_ns = time.time_ns()
            out += self.steps.stall_report(now_ns, self.options.host, device)
            out += self.profiler.busy_report(now_ns, self.options.job_id, self.options.rank,
                                             self.options.host)
        taken = recorder.take_all() if final else recorder.take_closed(time.time_ns())
        o = self.options
        clock = 0.0 if device is None else 1.0
        for window_start, functions in taken:
            out.extend(recorder.summaries(o.job_id, o.rank, window_start, functions))
            if window_start > self._clock_flagged_ns:  # once per window (late spans come again)
                self._clock_flagged_ns = window_start
                # Stamped at the window's end, as a sample of an interval is: the stream job
                # files it with the window's summaries (at its start it would fall in the
                # window before, closed by the time this one is sent: counted late, lost).
                out.append(MetricSample(job_id=o.job_id, host=o.host, rank=o.rank,
                                        ts_ns=window_start + recorder.window_ns,
                                        name=PHASE_CLOCK_DEVICE, value=clock))
        return out

    def check_device(self, tensor: Any) -> None:
        """At the first forward of a top model whose input is on a CUDA device (training
        thread): device timing starts."""
        self._device_checked = True
        factory = cuda_events()
        if factory is not None:
            self.device = DeviceTimer(factory)

    # -- control thread -----------------------------------------------------------------------
    def _on_control(self, message: ControlMessage) -> None:
        if message.action == "profile":
            self.profiler.request(message)
        else:
            self.guard.warn_once(
                f"control {message.action}", "trainscope: unknown control action %r", message.action
            )

    # -- the handle ---------------------------------------------------------------------------
    def _topology(self) -> Topology:
        """The job's layout as this rank knows it: every rank's coordinates follow from the
        sizes; only this rank's host is known here. Each rank sends one; the window engine merges
        them by rank, so every rank is expected (a silent one shows as a hang) and every host
        is kept.
        Past ``FULL_LAYOUT_MAX_RANKS`` a rank describes only itself, to bound the message.
        """
        o = self.options
        ranks = range(o.world_size) if o.world_size <= FULL_LAYOUT_MAX_RANKS else [o.rank]
        workers = []
        for rank in ranks:
            peer = dataclasses.replace(o, rank=rank)
            workers.append(
                WorkerInfo(
                    rank=rank,
                    host=o.host if rank == o.rank else "",
                    local_rank=o.local_rank if rank == o.rank else 0,
                    dp_rank=peer.dp_rank,
                    pp_stage=peer.pp_stage,
                    tp_rank=peer.tp_rank,
                )
            )
        return Topology(
            job_id=o.job_id, dp_size=o.dp_size, pp_size=o.pp_size, tp_size=o.tp_size,
            workers=workers,
        )

    def stats(self) -> dict[str, Any]:
        """Counts of what was recorded and what became of it (never raises).

        In records, as the transport layer's outbox counts them for every producer:
        ``records_submitted`` = ``records_acked`` (acknowledged by the broker: published) +
        ``records_dropped`` (queue full) + ``records_failed`` (given up: ``records_unsent``
        without a bus, ``records_abandoned`` at detach) + ``records_queued`` (held now, of which
        ``records_in_flight`` await the broker's verdict); ``records_sent`` (sends, a retry
        counts again) = ``records_acked`` + ``records_send_failures`` + ``records_in_flight``.
        Step records are submitted by the sender thread, within a round (0.5 s) of their step's
        end; ``steps_dropped`` counts those cleared before that because too many waited.
        """
        sender = self.sender.stats()
        return {
            "job_id": self.options.job_id,
            "rank": self.options.rank,
            "bus": self.bus_url,
            "active": self.active,
            "steps": self.steps.step,
            "steps_dropped": self.steps.log.dropped,
            "spans_recorded": self.recorder.recorded
            + sum(phase.pending() for phase in self.phase_logs),
            "spans_dropped": sum(phase.dropped for phase in self.phase_logs),
            "device_timing": self.device is not None,
            "device_spans_resolved": self.device.resolved if self.device is not None else 0,
            # Phases left without their device time: the event pool was dry (sender behind).
            "device_spans_dropped": self.device.dropped if self.device is not None else 0,
            # Step records sent before all their collectives' device times were known.
            "device_steps_unsettled": self.steps.device_steps_unsettled,
            "records_submitted": sender["submitted"],
            "records_acked": sender["acked"],
            "records_dropped": sender["dropped"],
            "records_failed": sender["failed"],
            "records_queued": sender["queued"],
            "records_in_flight": sender["in_flight"],
            "records_unsent": sender["unsent"],
            "records_abandoned": sender["abandoned"],
            "records_sent": sender["sent"],
            "records_send_failures": sender["send_failures"],
            "records_resent": sender["resent"],
            "bus_up": sender["bus_up"],
            "bus_errors": sender["bus_errors"],
            "connects": sender["connects"],
            "errors": self.guard.total(),
            "errors_by_kind": dict(self.guard.errors),
            "profile": dict(self.profiler.counts),
            "control": dict(self.control.counts) if self.control is not None else {},
        }

    def __repr__(self) -> str:
        o = self.options
        return f"<trainscope attachment job={o.job_id!r} rank={o.rank} bus={self.bus_url!r}>"


def _bus_factory(
    bus: Bus | str | None,
) -> tuple[str | None, Callable[[], Bus] | None, bool]:
    """(description, factory, whether we own what it returns)."""
    if bus is None or bus == "":
        return None, None, False
    if isinstance(bus, str):
        url = bus
        if url in ("memory", "memory://"):
            # One in-process bus for the process's lifetime, or consumers would see nothing.
            shared = open_bus(url)
            return url, lambda: shared, False
        open_bus_checked = _validated(url)
        return redact_url(url), open_bus_checked, True
    return type(bus).__name__, lambda: bus, False


def _validated(url: str) -> Callable[[], Bus]:
    if not url.startswith("kafka://") or not url.removeprefix("kafka://").strip("/"):
        raise ValueError(
            f"unknown bus URL {redact_url(url)!r}: expected 'memory' or 'kafka://HOST:PORT'"
        )
    # Bad TLS/SASL settings are bad options: say so at attach(), not in a background thread.
    parse_kafka_url(url)
    return lambda: open_bus(url)


def set_log_level(level: str | None) -> None:
    if level:
        logging.getLogger("trainscope").setLevel(level.upper())



def _hook_module(name: str) -> Any:
    """``trainscope.producers.torch.<name>``, imported when its installer runs."""
    return importlib.import_module(f"trainscope.producers.torch.{name}")
