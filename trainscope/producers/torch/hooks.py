"""The always-on hooks that need no change to the training script.

- forward/backward of the top-level model: global module hooks find the outermost module with
  trainable parameters during the first step, then are replaced by a wrapper of that module's
  class ``forward`` (see :func:`_forward_wrapper`), or by hooks on that module only where its
  class is one of torch's own (global hooks put every submodule call on PyTorch's slow path,
  which would cost ~1%); a step with no forward of that module starts discovery again (the
  script switched models);
- backward: see :mod:`trainscope.producers.torch.backward` (two persistent parameter hooks once
  calibrated; a hook on the forward's output and an autograd-engine callback until then);
- optimizer.step: the global optimizer step hooks; its end is also the step boundary;
- data-loader wait: ``next()`` on any DataLoader iterator;
- GC pauses: ``gc.callbacks``.

Every callback catches what it raises (the attachment's Guard counts it): it can fail, it
cannot raise. The per-step ones (forward, backward, optimizer, data loader) do so inline and
append ``start_ns, duration_ns`` to their phase's log (:mod:`.spanlog`): one ``time.time_ns()``
per timing point, nothing allocated per step that could be reused.
"""

from __future__ import annotations

import functools
import gc
import inspect
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainscope.producers.torch.backward import BackwardTimer

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

Uninstall = Callable[[], None]
_Tensor = torch.Tensor
# True while torch.compile traces (constant to the tracer, so a hook that returns on it adds
# nothing to the user's graph); older torch has no compiler, hence no tracing.
_is_compiling: Callable[[], bool] = getattr(getattr(torch, "compiler", None), "is_compiling",
                                            lambda: False)


def _is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(model)`` (by name: importing torch._dynamo to ask
    would cost every job a second of start-up)."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> torch.Tensor | None:
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


def _forward_wrapper(original: types.FunctionType, hooks: ModelHooks) -> types.FunctionType:
    """``original`` (a model class's ``forward``) timed by ``hooks`` when a top model calls it.

    Why a wrapper on the class rather than module hooks: any hook on a module puts its call on
    PyTorch's slow path (``Module._call_impl`` with hooks: a closure, a set, the hook dicts
    walked), which cost 2–7 µs per step in a real training loop, about as much as the timing
    itself. On the class rather than the instance: an instance attribute would be copied by
    ``copy.deepcopy`` (an EMA copy's forward would run the original model) and could not be
    pickled. Instances of the class that are not a top model pay one call and a set look-up.
    Each Python call on this path costs about 1 µs per step in a real loop (cold caches), so
    the checks are inline and the timing is two calls, each catching what it raises.

    The function is rebuilt with ``original``'s globals and metadata so that what inspects a
    model's forward sees the user's: ``inspect.signature`` follows ``__wrapped__``, and
    ``torch.jit.script`` compiles the original source and resolves its names in the original
    module. The wrapper's own code therefore names no global (``id`` comes in the closure: the
    user's module may define one).
    """
    _id = id

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if hooks._current is None and _id(self) in hooks._top_ids:
            hooks._begin(self, args, kwargs)
            if hooks._current is self:
                output = None
                try:
                    output = original(self, *args, **kwargs)
                    return output
                finally:
                    hooks._end(output)
        return original(self, *args, **kwargs)

    rebuilt = types.FunctionType(
        forward.__code__, original.__globals__, original.__name__, None, forward.__closure__
    )
    functools.update_wrapper(rebuilt, original)
    rebuilt.__trainscope_original__ = original  # type: ignore[attr-defined]
    return rebuilt


def _replaceable_forward(module: torch.nn.Module) -> types.FunctionType | None:
    """The class ``forward`` of ``module`` if it may be wrapped, else None (hook the module).

    Not: torch's own classes (``Sequential``, a compiled module's wrapper: shared by every
    model in the process), a module whose instance has its own ``forward`` (set by a library
    such as Accelerate: the class's would not run), a ``forward`` that is not a plain function,
    or one already wrapped.
    """
    cls = type(module)
    if cls.__module__.split(".", 1)[0] == "torch" or "forward" in module.__dict__:
        return None
    original = inspect.getattr_static(cls, "forward", None)
    if type(original) is not types.FunctionType or hasattr(original, "__trainscope_original__"):
        return None
    return original


class ModelHooks:
    """Forward and backward time of the top-level model(s)."""

    def __init__(self, att: Attachment) -> None:
        self.att = att
        # Global hooks, installed while the top modules are being looked for (the step
        # boundary reads it: non-empty means discovery).
        self.global_handles: list[Any] = []
        self._discovering = False  # whether the global hooks belong on (see _step_aside)
        self._module_handles: list[Any] = []
        # Classes whose forward is wrapped: (class, its own forward attribute or None).
        self._wrapped_classes: list[tuple[type, Any]] = []
        self._top_ids: set[int] = set()  # the settled top modules (hooked or wrapped)
        self._tops: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
        self._trainable: weakref.WeakKeyDictionary[torch.nn.Module, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._thread = 0  # the thread that runs the model; others are ignored
        self._depth = 0
        self._current: torch.nn.Module | None = None
        self._forward_start_ns = 0
        self._device_start: Any = None  # the forward's start event, with device timing
        # Forwards of a top model since the last step boundary (which reads it: none in a step
        # means the script switched models).
        self.forwards_in_step = 0
        self.backward = BackwardTimer(att)
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
        self._wrapper_pre = g.wrap("forward hook", self._wrapper_pre_impl)

    def install(self) -> Uninstall:
        # torch.compile warns, at a compiled model's call, that global module hooks fire an
        # extra time for it. Ours step aside for that call (_step_aside); without the filter
        # every compiled job would be warned about hooks it never installed.
        warnings.filterwarnings(
            "ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks",
            category=UserWarning)
        self._install_global()
        return self.uninstall

    def _install_global(self) -> None:
        from torch.nn.modules import module as nn_module

        self._discovering = True
        self.global_handles = [
            nn_module.register_module_forward_pre_hook(self._global_pre),
            nn_module.register_module_forward_hook(self._global_post, always_call=True),
        ]

    def uninstall(self) -> None:
        self._discovering = False
        for handle in self.global_handles + self._module_handles:
            handle.remove()
        self.global_handles = []
        self._module_handles = []
        self._unwrap_forwards()
        self.backward.remove_hooks()

    def _unwrap_forwards(self) -> None:
        self._top_ids = set()  # a wrapper left in place (see below) now only passes through
        for cls, own in self._wrapped_classes:
            current = cls.__dict__.get("forward")
            if getattr(current, "__trainscope_original__", None) is None:
                continue  # replaced since by someone else, who may call ours: left as it is
            if own is None:
                delattr(cls, "forward")
            else:
                cls.forward = own
        self._wrapped_classes = []

    def quiet_at_step_end(self) -> bool:
        """Whether :meth:`on_step_end` would only reset the step's forward count: settled, a
        forward this step, backward timed by the two parameter hooks and both reached. The step
        boundary inlines this test (the usual case then costs no call); this is its reference."""
        backward = self.backward
        return bool(self.forwards_in_step and not self.global_handles and backward.settled
                    and not backward.pass_open and not backward.missed)

    def on_step_end(self) -> None:
        """At a step boundary: settle on the models found, or look again if they stopped running.

        A step without any top-level forward after settling means the script now trains
        another model (or re-created it), so discovery starts over.
        """
        forwards, self.forwards_in_step = self.forwards_in_step, 0
        if self.global_handles:
            if self._tops:
                self._settle()
        elif forwards == 0:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles = []
            self._unwrap_forwards()
            self._tops = weakref.WeakSet()
            self._wrappers = weakref.WeakSet()
            self.backward.reset()
            self._install_global()
        elif not self.backward.settled or self.backward.unsettled():
            # Not in the settled fast path: iterating a WeakSet costs more than the rest here.
            self.backward.on_step_end(list(self._tops))

    def _settle(self) -> None:
        self._discovering = False
        for handle in self.global_handles:
            handle.remove()
        self.global_handles = []
        for wrapper in list(self._wrappers):
            self._module_handles.append(wrapper.register_forward_pre_hook(self._wrapper_pre))
        for module in list(self._tops):
            self._top_ids.add(id(module))
            if self._wrap_forward(module):
                continue
            self._module_handles.append(
                module.register_forward_pre_hook(self._module_pre, with_kwargs=True)
            )
            self._module_handles.append(
                module.register_forward_hook(self._module_post, always_call=True)
            )
        self.backward.settle(list(self._tops))

    def _wrap_forward(self, module: torch.nn.Module) -> bool:
        original = _replaceable_forward(module)
        if original is None:
            return False
        cls = type(module)
        if all(c is not cls for c, _ in self._wrapped_classes):
            self._wrapped_classes.append((cls, cls.__dict__.get("forward")))
            cls.forward = _forward_wrapper(original, self)
        return True

    # -- discovery phase: global hooks ----------------------------------------------------------

    def _is_trainable(self, module: torch.nn.Module) -> bool:
        known = self._trainable.get(module)
        if known is None:
            known = self._trainable[module] = any(p.requires_grad for p in module.parameters())
        return known

    def _global_pre_impl(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if _is_compiling():
            # Traced by torch.compile (a submodule's call inside a compiled model): nothing to
            # time there, and any call below would break the user's graph (get_ident cannot be
            # traced). The compiled model's own call, outside, is timed.
            return
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
        if _is_compiled(module):
            self._step_aside(module)

    def _step_aside(self, module: torch.nn.Module) -> None:
        """The global hooks off for the call of a compiled model (``torch.compile``'s
        ``OptimizedModule``), back on after it (a hook of that call ends its forward).

        torch.compile traces the model with the global hooks installed at its first call, and
        guards on them: traced with ours, it compiled the whole model a second time once they
        were gone (at the step boundary that settles), which for a large model is minutes.
        A compiled top model is timed as one forward from outside; a compiled part of a model
        is inside its top's forward; what compiled code calls is not ours to see, but a DDP
        wrapper compiled inside (``torch.compile(DDP(model))``) gets its all-reduce timing
        now, as the hooks would have given it at its call."""
        inner = getattr(module, "_orig_mod", None)
        if inner is not None and id(inner) not in self.att._ddp_seen:
            self.att.on_forward_begin(inner)
        for handle in self.global_handles:
            handle.remove()
        self.global_handles = []
        handles: list[Any] = []

        def back_on(compiled: torch.nn.Module, args: Any, output: Any) -> None:
            for handle in handles:
                handle.remove()
            self._global_post(compiled, args, output)
            if self._discovering and not self.global_handles:
                self._install_global()

        handles.append(module.register_forward_hook(back_on, always_call=True))

    def _global_post_impl(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if _is_compiling() or self._current is None or threading.get_ident() != self._thread:
            return
        self._depth -= 1
        if self._depth == 0 and module is self._current:
            self._end(output)

    def _wrapper_pre_impl(self, module: torch.nn.Module, args: Any) -> None:
        if self._current is None:
            self._wrapper_start_ns = time.time_ns()
            self.att.on_forward_begin(module)

    # -- settled phase: hooks on the top-level modules, or their class forward wrapped ----------

    def __deepcopy__(self, memo: dict[int, Any]) -> ModelHooks:
        """A deep copy of a hooked model (an EMA copy) shares these hooks, which ignore it."""
        return self

    def __reduce__(self) -> tuple[type, tuple[()]]:
        """A pickled hooked model is loaded with hooks that do nothing (not with our lock)."""
        return _InertModelHooks, ()

    def _module_pre(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if self._current is None and id(module) in self._top_ids:
            self._begin(module, args, kwargs)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module is self._current:
            self._end(output)

    # -- shared: the start and end of a top model's forward (each catches what it raises) ------
    def _begin(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        try:
            now = time.time_ns()
            self._current = module
            self._depth = 0
            self._forward_start_ns = now
            att = self.att
            if self._wrapper_start_ns:
                wrapper_start, self._wrapper_start_ns = self._wrapper_start_ns, 0
                att.record("collective", "ddp_pre_forward", wrapper_start, now - wrapper_start)
            steps = att.steps
            if not steps.start_ns:
                steps.start_ns = now
                att.recorder.step_started(now)
            # The common case inline, without a call or building a tuple.
            first = args[0] if args and type(args[0]) is _Tensor else _first_tensor(args, kwargs)
            if not att._device_checked and first is not None and first.is_cuda:
                att.check_device(first)  # once: device timing starts
            device = att.device
            if device is not None:
                self._device_start = device.begin(self._device_start)
            if first is not None:
                shape = first.shape
                if shape:  # the step's samples and tokens (inline: one call fewer per step)
                    steps.samples += shape[0]
                    if len(shape) >= 2 and not first.is_floating_point():
                        steps.tokens += first.numel()
            if id(module) not in att._ddp_seen:
                att.on_forward_begin(module)
        except Exception as exc:
            self.att.guard.report("forward hook", exc)

    def _end(self, output: Any) -> None:
        try:
            now = time.time_ns()
            start = self._forward_start_ns
            self._current = None
            self._depth = 0
            self.forwards_in_step += 1
            if not self.backward.settled:
                self.backward.arm(output)  # first: a failure to record the forward must not skip it
            att = self.att
            device = att.device
            if device is not None:
                device.end(device.forward, start, self._device_start)
                self._device_start = None
            if att.active:
                pairs = att.forward_log.values
                pairs.append(start)
                pairs.append(now - start)
                if att.optrace is not None:
                    att.on_forward_end(start, now)
        except Exception as exc:
            self.att.guard.report("forward hook", exc)


class _InertModelHooks:
    """What the module hooks of a model pickled while attached become when it is loaded."""

    def _module_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        return None

    def _module_post(self, module: Any, args: Any, output: Any) -> None:
        return None


def install_optimizer_hooks(att: Attachment) -> Uninstall:
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    starts: dict[int, int] = {}
    device_starts: dict[int, Any] = {}
    report = att.guard.report

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            starts[id(optimizer)] = time.time_ns()
            device = att.device
            if device is not None:  # a start still there is a step that raised
                device_starts[id(optimizer)] = device.begin(device_starts.get(id(optimizer)))
        except Exception as exc:
            report("optimizer hook", exc)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        now = time.time_ns()
        start = now
        try:
            start = starts.pop(id(optimizer), now)
            device = att.device
            if device is not None:
                device.end(device.optimizer, start, device_starts.pop(id(optimizer), None))
            if att.active:
                pairs = att.optimizer_log.values
                pairs.append(start)
                pairs.append(now - start)
        except Exception as exc:
            report("optimizer hook", exc)
        try:  # apart: a failure to record the span must not skip the step boundary
            if att.optrace is not None:
                att.optrace.add("optimizer", start, now)
            steps = att.steps
            if not steps.explicit:
                end_step_if_pacing(att, optimizer, now)
        except Exception as exc:
            report("optimizer hook", exc)

    handles = [
        register_optimizer_step_pre_hook(pre),
        register_optimizer_step_post_hook(post),
    ]

    def uninstall() -> None:
        for handle in handles:
            handle.remove()

    return uninstall


def end_step_if_pacing(att: Attachment, optimizer: Any, now_ns: int) -> None:
    """The step ends with the pacing optimizer's step: the first to step, or the next one to
    step once it has been garbage-collected (steps.py)."""
    steps = att.steps
    pacer = steps.pacer() if steps.pacer is not None else None
    if pacer is None:
        steps.pacer = weakref.ref(optimizer)
        pacer = optimizer
    if pacer is optimizer:
        att.end_step(now_ns)


def install_dataloader_hook(att: Attachment) -> Uninstall:
    from torch.utils.data import dataloader

    cls = dataloader._BaseDataLoaderIter
    original = cls.__next__
    time_ns = time.time_ns
    report = att.guard.report
    steps = att.steps

    def __next__(self: Any) -> Any:
        start = time_ns()
        try:
            return original(self)
        finally:
            # StopIteration also took time the loop spent waiting; it is counted too.
            end = time_ns()
            try:
                if att.active:
                    if not steps.start_ns:
                        steps.start_ns = start
                        att.recorder.step_started(start)
                    pairs = att.dataloader_log.values
                    pairs.append(start)
                    pairs.append(end - start)
            except Exception as exc:
                report("dataloader hook", exc)

    return replace_method(cls, "__next__", __next__)


def replace_method(cls: type, name: str, wrapper: Callable[..., Any]) -> Uninstall:
    """``cls.name`` replaced by ``wrapper`` (which calls the original, kept on it as
    ``__trainscope_original__``); the uninstall puts the original back unless someone has
    replaced ours meanwhile."""
    original = getattr(cls, name)
    wrapper.__trainscope_original__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)

    def uninstall() -> None:
        if cls.__dict__.get(name) is wrapper:
            setattr(cls, name, original)

    return uninstall


def install_gc_hook(att: Attachment) -> Uninstall:
    """Time every collection, on whatever thread triggers it.

    The pause goes to the GC's own phase log (two array appends), never to the recorder: a
    collection starts inside any allocation, including one made while this very thread holds
    the recorder's lock (the sender taking closed windows, a hook adding a span), and recording
    there waited forever on a lock its own thread held. Seen as a 4-rank DDP job whose one rank
    stopped in the sender's ``take_closed`` and its peers in the next all-reduce.
    """
    starts: dict[int, int] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            starts[ident] = time.time_ns()
            return
        start = starts.pop(ident, 0)
        # Before the first sign of training (imports, building the model) a pause is no
        # step's cost, and in windows without steps it would read as a cost per step.
        if start and att.active and att.steps.start_ns:
            # Collections do not nest, so nothing else appends to this log between the two.
            pairs = att.gc_log.values
            pairs.append(start)
            pairs.append(time.time_ns() - start)

    guarded = att.guard.wrap("gc hook", callback)
    gc.callbacks.append(guarded)

    def uninstall() -> None:
        if guarded in gc.callbacks:
            gc.callbacks.remove(guarded)

    return uninstall
