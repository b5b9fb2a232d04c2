"""Backward time of the top-level model(s), at about 1 µs per step once settled.

Two mechanisms, the cheap one once it is known to be right for the model:

- **exact** (the first steps, and for good when the cheap one does not fit): a hook on the
  forward's output tensor marks the start (the gradient reaching the model), an autograd-engine
  callback queued from it the end (queued before DDP's own, so it excludes DDP's final wait for
  the gradient all-reduce). It registers a Python hook on a new tensor every forward and the
  engine calls Python twice: ~20–25 µs per step on a slow CPU, half of the producer's cost.
- **parameters** (settled): two persistent ``register_post_accumulate_grad_hook`` hooks, on the
  parameter whose gradient is accumulated first in a backward pass (start) and on the one
  accumulated last (end). Registered once, called with a tensor Python already holds: ~1 µs
  per step. Coarser: the start is when the first parameter gradient is accumulated (after the
  loss's backward and that of the model's last parameterised layer), not when the gradient
  reaches the model's output; the end is the same point in practice (the last gradient), still
  before DDP's final wait.

Which parameters are first and last is learnt in one **calibration** step (after forward
discovery settles): every trainable parameter of the top modules gets a hook that notes the
order, while the exact mechanism times the step and marks where each backward pass ends. If
every pass saw the same first and last parameter (and they differ), the cheap mechanism takes
over; otherwise (a GAN's different passes, a single parameter, parameters that never get a
gradient hook called, FSDP's flat parameters) the exact one stays. A settled step whose backward
did not reach both hooks (a parameter unused that step) starts calibration again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

EXACT, CALIBRATING, PARAMETERS = "exact", "calibrating", "parameters"
_MAX_OUTPUT_TENSORS = 4


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """Up to four tensors of a forward's output that require grad (where backward enters)."""
    found: list[torch.Tensor] = []
    stack = [output]
    while stack and len(found) < _MAX_OUTPUT_TENSORS:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                found.append(value)
        elif isinstance(value, list | tuple):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return found


class BackwardTimer:
    """Times each backward pass through the top modules into the attachment's backward log."""

    def __init__(self, att: Attachment) -> None:
        self.att = att
        self.mode = CALIBRATING
        # mode == PARAMETERS, as an attribute for the per-step tests (runtime imports no torch).
        self.settled = False
        self._handles: list[Any] = []
        self._order: list[int] = []  # calibration: parameters (id) in accumulation order
        self._passes: list[tuple[int, int] | None] = []  # calibration: (first, last) per pass
        # Settled mode: a pass has reached its first hook and not yet its last; a last hook was
        # reached without a first. Both read at every step boundary (``Attachment.end_step``).
        self.pass_open = False
        self._start_ns = 0
        self.missed = False
        self._device_start: Any = None  # the settled pass's start event, with device timing
        self._exact_start = att.guard.wrap("backward hook", self._exact_start_impl)

    # -- life cycle (training thread, at step boundaries) -----------------------------------
    def _set_mode(self, mode: str) -> None:
        self.mode = mode
        self.settled = mode == PARAMETERS

    def settle(self, tops: list[torch.nn.Module]) -> None:
        """Forward discovery found ``tops``: calibrate on their parameters during the next step."""
        self.remove_hooks()
        self._set_mode(CALIBRATING)
        self._order, self._passes = [], []
        seen: set[int] = set()
        for module in tops:
            for param in module.parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    self._handles.append(
                        param.register_post_accumulate_grad_hook(self._calibration_hook)
                    )

    def unsettled(self) -> bool:
        """Whether the last step's passes missed a parameter hook (the settled mode's check)."""
        return self.pass_open or self.missed

    def on_step_end(self, tops: list[torch.nn.Module]) -> None:
        if self.mode == PARAMETERS:
            if self.pass_open or self.missed:  # a pass that did not reach both hooks
                self.pass_open = self.missed = False
                self.settle(tops)
        elif self.mode == CALIBRATING and self._passes:
            self._decide(tops)

    def _decide(self, tops: list[torch.nn.Module]) -> None:
        passes, self._passes = self._passes, []
        self.remove_hooks()
        first_last = passes[0]
        if first_last is None or first_last[0] == first_last[1] or any(
            p != first_last for p in passes
        ):
            self._set_mode(EXACT)
            return
        params = {id(p): p for module in tops for p in module.parameters()}
        first, last = params.get(first_last[0]), params.get(first_last[1])
        if first is None or last is None:
            self._set_mode(EXACT)
            return
        self.pass_open = self.missed = False
        self._handles = [
            first.register_post_accumulate_grad_hook(self._first_hook),
            last.register_post_accumulate_grad_hook(self._last_hook),
        ]
        self._set_mode(PARAMETERS)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """Discovery starts over (the script switched models)."""
        self.remove_hooks()
        self._set_mode(CALIBRATING)
        self._order, self._passes = [], []

    # -- settled: two persistent parameter hooks (the engine's thread) -------------------------
    def _first_hook(self, _param: torch.Tensor) -> None:
        if not self.pass_open:
            self._start_ns = time.time_ns()
            self.pass_open = True
            device = self.att.device
            if device is not None:  # a start still there is a pass that missed its last hook
                self._device_start = device.begin(self._device_start)

    def _last_hook(self, _param: torch.Tensor) -> None:
        end = time.time_ns()
        try:
            if not self.pass_open:
                self.missed = True
                return
            self.pass_open = False
            start = self._start_ns
            att = self.att
            device = att.device
            if device is not None:
                device.end(device.backward, start, self._device_start)
                self._device_start = None
            if att.active:
                pairs = att.backward_log.values
                pairs.append(start)
                pairs.append(end - start)
                if att.optrace is not None:
                    att.on_backward_end(start, end)
        except Exception as exc:
            self.att.guard.report("backward hook", exc)

    # -- calibration and exact: a hook on the output, an engine callback -----------------------
    def _calibration_hook(self, param: torch.Tensor) -> None:
        self._order.append(id(param))

    def arm(self, output: Any) -> None:
        """At the end of a forward: the exact mechanism, unless the parameters' hooks time it."""
        if self.mode == PARAMETERS:
            return
        tensors = grad_tensors(output)
        if tensors:
            state = [False]
            exact_start = self._exact_start

            def on_grad(_grad: torch.Tensor) -> None:
                exact_start(state)

            for tensor in tensors:
                tensor.register_hook(on_grad)

    def _exact_start_impl(self, state: list[bool]) -> None:
        if state[0]:
            return
        state[0] = True
        start = time.time_ns()
        att = self.att
        self._order = []
        device = att.device
        device_start = device.begin() if device is not None else None

        def on_backward_end() -> None:
            try:
                end = time.time_ns()
                if device is not None:
                    device.end(device.backward, start, device_start)
                att.record("torch_op", "backward", start, end - start)
                att.on_backward_end(start, end)
                if self.mode == CALIBRATING:
                    order = self._order
                    self._passes.append((order[0], order[-1]) if order else None)
                    self._order = []
            except Exception as exc:
                att.guard.report("backward hook", exc)

        torch.autograd.Variable._execution_engine.queue_callback(on_backward_end)
