"""Step boundaries and the per-step record.

A step ends at the post-hook of the first optimizer that stepped (the "pacing" optimizer;
with several optimizers per iteration, e.g. a GAN, the others fall inside the step; when it is
garbage-collected the next one to step takes over), or at the end of an explicit
``trainscope.step()`` block once the script uses one.
A step starts where the previous one ended (so data-loading time between iterations belongs to
the step), the very first at the first sign of training activity.

The training thread only appends a step's six integers to an :class:`~.spanlog.IntLog` (as
the phase logs do for spans); the sender thread packs them, column by column, into one
:class:`StepBatch` per round. Building a record and taking the outbox's lock on every step cost
more than every other part of the step boundary together, and the stream job windows step
records as columns (a row per step would be decoded and checked one object at a time).

On a CUDA job a step's record also carries its collectives' device time
(``device_collective_ns``, from :class:`~.device_timing.DeviceTimer`), known only once the GPU
has run them: the sender holds a step's record back until then, at most
:data:`DEVICE_HOLD_MIN_S` or :data:`DEVICE_HOLD_STEPS` recent steps (a GPU runs a step or two
behind the host; a hung one never catches up), after which the record goes with what resolved
and is counted in ``device_steps_unsettled``.
"""

from __future__ import annotations

import statistics
import weakref
from collections import deque
from typing import Any

import numpy as np

from trainscope.producers.torch.device_timing import DeviceTimer
from trainscope.producers.torch.spanlog import IntLog
from trainscope.schemas import metrics as m
from trainscope.schemas.records import MetricSample, StepBatch

# Integers per step in the log: step, start_ns, duration_ns, samples, tokens, collective_ns.
_FIELDS = 6
# Past this many steps waiting (the sender thread stuck, or gone) the log is cleared and the
# steps counted as dropped, so memory stays bounded.
MAX_PENDING_STEPS = 1 << 16
# A step open this long, and STALL_STEPS times the recent median step, is reported as it goes
# (the stream job's early flag names the rank its peers wait for, detectors/early.py).
STALL_MIN_S = 3.0
STALL_STEPS = 4.0
# Recent step durations the sender thread keeps, for that median.
_RECENT = 32
# How long a step's record waits for its collectives' device time (see the module's docstring).
DEVICE_HOLD_MIN_S = 2.0
DEVICE_HOLD_STEPS = 4.0


class StepTracker:
    def __init__(self, job_id: str, rank: int) -> None:
        self.job_id = job_id
        self.rank = rank
        self.step = 0
        self.explicit = False
        self.pacer: weakref.ref[Any] | None = None
        self.start_ns = 0
        # The step's samples and tokens so far, added to by the forward's start.
        self.samples = 0
        self.tokens = 0
        # Added to by the collective hooks, some on a backend's thread (an asynchronous
        # collective's completion): a completion racing the step's end may land in the next
        # step, which moves time between neighbouring steps, never loses it.
        self.collective_ns = 0
        # Collectives issued and not yet completed: id -> issue time (ns). A dict, whose set
        # and pop are atomic, because completions come on a backend's thread.
        self.pending: dict[int, int] = {}
        self._recent_ns: deque[int] = deque(maxlen=_RECENT)
        self.log = IntLog(_FIELDS, MAX_PENDING_STEPS)
        # Steps ended whose collectives were still running on the device (sender thread).
        self._held = np.zeros((0, _FIELDS), dtype=np.int64)
        self.device_steps_unsettled = 0

    def activity(self, now_ns: int) -> None:
        if not self.start_ns:
            self.start_ns = now_ns

    def end(self, now_ns: int, samples: int | None = None, tokens: int | None = None) -> int:
        """End the step in progress at ``now_ns`` (training thread); returns its number."""
        start = self.start_ns or now_ns
        step = self.step
        self.log.values.extend((
            step,
            start,
            now_ns - start if now_ns > start else 0,
            self.samples if samples is None else samples,
            self.tokens if tokens is None else tokens,
            self.collective_ns,
        ))
        self.step = step + 1
        self.start_ns = now_ns
        self.samples = 0
        self.tokens = 0
        self.collective_ns = 0
        return step

    def drain(self, device: DeviceTimer | None = None, now_ns: int = 0,
              final: bool = False) -> list[StepBatch]:
        """The steps ended since the last drain, as one batch (none if no step ended; sender
        thread). With ``device`` (resolved just before), each step with its collectives'
        device time; a step whose collectives are still running on the device, and the steps
        after it, wait for a later drain (see the module's docstring) unless ``final``."""
        values = np.array(self.log.take(), dtype=np.int64).reshape(-1, _FIELDS)
        if len(values):
            self._recent_ns.extend(values[:, 2].tolist())
        device_ns: list[int] | None = None
        if device is not None:
            if len(self._held):
                values = np.concatenate([self._held, values])
            device_ns = self._device_times(device, values, now_ns, final)
            self._held = values[len(device_ns):]
            values = values[:len(device_ns)]
        if not len(values):
            return []
        return [StepBatch.from_arrays(
            job_id=self.job_id, rank=np.full(len(values), self.rank), step=values[:, 0],
            start_ns=values[:, 1], duration_ns=values[:, 2], samples=values[:, 3],
            tokens=values[:, 4], collective_ns=values[:, 5], device_collective_ns=device_ns)]

    def _device_times(self, device: DeviceTimer, values: np.ndarray, now_ns: int,
                      final: bool) -> list[int]:
        """The device collective time of the leading steps that can go now, in order."""
        if not len(values):
            return []
        recent_ns = statistics.median(self._recent_ns) if self._recent_ns else 0
        hold_ns = max(DEVICE_HOLD_MIN_S * 1e9, DEVICE_HOLD_STEPS * recent_ns)
        taken: list[int] = []
        for step, start_ns, duration_ns in values[:, :3].tolist():
            device_ns = device.take_step(step)
            if device_ns is None:
                if not final and now_ns - (start_ns + duration_ns) < hold_ns:
                    break
                self.device_steps_unsettled += 1
                device_ns = device.take_step(step, force=True) or 0
            taken.append(device_ns)
        return taken

    def stall_report(self, now_ns: int, host: str, device: DeviceTimer | None = None
                     ) -> list[MetricSample]:
        """While the step in progress has been open for STALL_MIN_S and STALL_STEPS recent
        steps: how long, and how long this rank has been waiting in a collective (sender
        thread, after :meth:`drain`): on the host, or with ``device``, on the device since
        the host issued it. Nothing otherwise: a healthy job sends no such sample."""
        start = self.start_ns
        if not start or not self._recent_ns:
            return []
        open_ns = now_ns - start
        if open_ns < max(STALL_MIN_S * 1e9, STALL_STEPS * statistics.median(self._recent_ns)):
            return []
        issued = list(self.pending.values())
        if device is not None:
            running_since_ns = device.collective_running_since_ns()
            if running_since_ns is not None:
                issued.append(running_since_ns)
        waiting_ns = now_ns - min(issued) if issued else 0
        return [
            MetricSample(job_id=self.job_id, host=host, rank=self.rank, ts_ns=now_ns,
                         name=name, value=round(value / 1e9, 3))
            for name, value in ((m.STEP_OPEN_S, open_ns), (m.COLLECTIVE_WAIT_S, waiting_ns))
        ]
