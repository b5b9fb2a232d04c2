"""The always-on hooks that need no change to the training script.

- forward/backward of the top-level model: global module hooks find the outermost module with
  trainable parameters during the first step, then are replaced by hooks on that module only
  (global hooks put every submodule call on PyTorch's slow path, which would cost ~1%); a step
  with no forward of that module starts discovery again (the script switched models);
- backward: a hook on the forward's output marks its start, an autograd-engine callback its end
  (queued before DDP's own, so it excludes DDP's final wait for the gradient all-reduce);
- optimizer.step: the global optimizer step hooks; its end is also the step boundary;
- data-loader wait: ``next()`` on any DataLoader iterator;
- GC pauses: ``gc.callbacks``.

Every callback is wrapped by the attachment's Guard: it can fail, it cannot raise.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

Uninstall = Callable[[], None]
_MAX_OUTPUT_TENSORS = 4


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> torch.Tensor | None:
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _grad_tensors(output: Any) -> list[torch.Tensor]:
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


class ModelHooks:
    """Forward and backward time of the top-level model(s)."""

    def __init__(self, att: Attachment) -> None:
        self.att = att
        self._global_handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._tops: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._trainable: weakref.WeakKeyDictionary[torch.nn.Module, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._thread = 0  # the thread that runs the model; others are ignored
        self._depth = 0
        self._current: torch.nn.Module | None = None
        self._forward_start_ns = 0
        self._forwards_in_step = 0
        # DDP wrappers are looked through: "forward" is the wrapped model's own compute, and
        # the wrapper's work before it (buffer broadcast, bucket rebuilds: waiting on peers)
        # is recorded apart as collective/ddp_pre_forward.
        self._wrappers: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._wrapper_start_ns = 0
        from torch.nn.parallel import DistributedDataParallel

        self._wrapper_types: tuple[type, ...] = (DistributedDataParallel,)
        g = att.guard
        self._global_pre = g.wrap("forward hook", self._global_pre_impl)
        self._global_post = g.wrap("forward hook", self._global_post_impl)
        self._module_pre = g.wrap("forward hook", self._module_pre_impl)
        self._module_post = g.wrap("forward hook", self._module_post_impl)
        self._backward_start = g.wrap("backward hook", self._backward_start_impl)
        self._wrapper_pre = g.wrap("forward hook", self._wrapper_pre_impl)

    def install(self) -> Uninstall:
        self._install_global()
        return self.uninstall

    def _install_global(self) -> None:
        from torch.nn.modules import module as nn_module

        self._global_handles = [
            nn_module.register_module_forward_pre_hook(self._global_pre),
            nn_module.register_module_forward_hook(self._global_post, always_call=True),
        ]

    def uninstall(self) -> None:
        for handle in self._global_handles + self._module_handles:
            handle.remove()
        self._global_handles = []
        self._module_handles = []

    def on_step_end(self) -> None:
        """At a step boundary: settle on the models found, or look again if they stopped running.

        A step without any top-level forward after settling means the script now trains
        another model (or re-created it), so discovery starts over.
        """
        forwards, self._forwards_in_step = self._forwards_in_step, 0
        if self._global_handles:
            if self._tops:
                self._settle()
        elif forwards == 0:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles = []
            self._tops = weakref.WeakSet()
            self._wrappers = weakref.WeakSet()
            self._install_global()

    def _settle(self) -> None:
        for handle in self._global_handles:
            handle.remove()
        self._global_handles = []
        for wrapper in list(self._wrappers):
            self._module_handles.append(wrapper.register_forward_pre_hook(self._wrapper_pre))
        for module in list(self._tops):
            self._module_handles.append(
                module.register_forward_pre_hook(self._module_pre, with_kwargs=True)
            )
            self._module_handles.append(
                module.register_forward_hook(self._module_post, always_call=True)
            )

    # -- discovery phase: global hooks ----------------------------------------------------------

    def _is_trainable(self, module: torch.nn.Module) -> bool:
        known = self._trainable.get(module)
        if known is None:
            known = self._trainable[module] = any(p.requires_grad for p in module.parameters())
        return known

    def _global_pre_impl(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        ident = threading.get_ident()
        if self._thread and ident != self._thread:
            return
        if self._current is None and isinstance(module, self._wrapper_types):
            self._wrappers.add(module)
            self._wrapper_pre_impl(module, args)
            return
        if self._depth == 0 and self._is_trainable(module):
            self._thread = ident
            self._tops.add(module)
            self._begin(module, args, None)
        if self._current is not None:
            self._depth += 1

    def _global_post_impl(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._current is None or threading.get_ident() != self._thread:
            return
        self._depth -= 1
        if self._depth == 0 and module is self._current:
            self._end(output)

    def _wrapper_pre_impl(self, module: torch.nn.Module, args: Any) -> None:
        if self._current is None:
            self._wrapper_start_ns = time.time_ns()
            self.att.on_forward_begin(module)

    # -- settled phase: hooks on the top-level modules only -------------------------------------

    def _module_pre_impl(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self._current is None:
            self._begin(module, args, kwargs)

    def _module_post_impl(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module is self._current:
            self._end(output)

    # -- shared -------------------------------------------------------------------------------
    def _begin(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        now = time.time_ns()
        self._current = module
        self._depth = 0
        self._forward_start_ns = now
        att = self.att
        wrapper_start, self._wrapper_start_ns = self._wrapper_start_ns, 0
        if wrapper_start:
            att.record("collective", "ddp_pre_forward", wrapper_start, now - wrapper_start)
        att.steps.activity(now)
        first = _first_tensor(args, kwargs)
        if first is not None and first.dim() >= 1:
            tokens = first.numel() if first.dim() >= 2 and not first.is_floating_point() else 0
            att.steps.add_samples(int(first.shape[0]), int(tokens))
        att.on_forward_begin(module)

    def _end(self, output: Any) -> None:
        now = time.time_ns()
        start = self._forward_start_ns
        self._current = None
        self._depth = 0
        self._forwards_in_step += 1
        self.att.record("torch_op", "forward", start, now - start)
        self.att.on_forward_end(start, now)
        tensors = _grad_tensors(output)
        if tensors:
            state = [False]

            def on_grad(_grad: torch.Tensor) -> None:
                self._backward_start(state)

            for tensor in tensors:
                tensor.register_hook(on_grad)

    def _backward_start_impl(self, state: list[bool]) -> None:
        if state[0]:
            return
        state[0] = True
        start = time.time_ns()
        att = self.att

        def on_backward_end() -> None:
            try:
                end = time.time_ns()
                att.record("torch_op", "backward", start, end - start)
                att.on_backward_end(start, end)
            except Exception as exc:
                att.guard.report("backward hook", exc)

        torch.autograd.Variable._execution_engine.queue_callback(on_backward_end)


def install_optimizer_hooks(att: Attachment) -> Uninstall:
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    starts: dict[int, int] = {}

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        starts[id(optimizer)] = time.time_ns()

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.time_ns()
        start = starts.pop(id(optimizer), now)
        att.record("torch_op", "optimizer.step", start, now - start)
        att.on_optimizer_step(optimizer, start, now)

    handles = [
        register_optimizer_step_pre_hook(att.guard.wrap("optimizer hook", pre)),
        register_optimizer_step_post_hook(att.guard.wrap("optimizer hook", post)),
    ]

    def uninstall() -> None:
        for handle in handles:
            handle.remove()

    return uninstall


def install_dataloader_hook(att: Attachment) -> Uninstall:
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    original = cls.__next__
    record = att.guard.wrap("dataloader hook", att.on_next_batch)

    def __next__(self: Any) -> Any:
        start = time.time_ns()
        try:
            return original(self)
        finally:
            # StopIteration also took time the loop spent waiting; it is counted too.
            record(start, time.time_ns())

    __next__.__trainscope_original__ = original  # type: ignore[attr-defined]
    cls.__next__ = __next__  # type: ignore[method-assign]

    def uninstall() -> None:
        if cls.__next__ is __next__:
            cls.__next__ = original  # type: ignore[method-assign]

    return uninstall


def install_gc_hook(att: Attachment) -> Uninstall:
    starts: dict[int, int] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            starts[ident] = time.time_ns()
            return
        start = starts.pop(ident, 0)
        if start:
            att.record("gc", "gc.collect", start, time.time_ns() - start)

    guarded = att.guard.wrap("gc hook", callback)
    gc.callbacks.append(guarded)

    def uninstall() -> None:
        if guarded in gc.callbacks:
            gc.callbacks.remove(guarded)

    return uninstall
