"""torch.distributed collectives (op, bytes, duration, group) and DDP's gradient all-reduce.

Collectives are timed by wrapping the functions of the ``torch.distributed`` namespace (what
``dist.all_reduce(...)`` resolves to). A blocking call is timed around the call; an
``async_op=True`` call from its issue to its completion (a callback on the work's future), so
the duration always includes waiting for the slowest peer — which is why detectors read
``collective`` time as "possibly waiting", not as this rank's own work.

On a CUDA job each collective is also timed on the device (:mod:`device_timing`): a start event
on the current stream at the call (where the stream reaches the collective), an end event where
the stream is done with it. For a blocking call that is on its return; for an asynchronous one
(and DDP's buckets) in the completion callback of the work's future, which torch runs on streams
synchronised with the collective's kernels (``torch.futures.Future.then``), so the end event
is queued after them without anything waiting. For NCCL, whose host call returns at once, that
device time is the only clock on which a rank's peers are seen waiting for it. Each collective's
device time is also added to the step it was issued in (the step record's
``device_collective_ns``), once its events completed.

DDP reduces gradients in C++ without these functions; a communication hook that performs the
same averaging all-reduce as DDP's default times each bucket as ``ddp_allreduce``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainscope.producers.torch.device_timing import DEVICE_COLLECTIVE_LAYER, DeviceTimer
from trainscope.producers.torch.threadstate import keep_thread_state

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

Uninstall = Callable[[], None]

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    # FSDP2 (fully_shard) calls these two (torch 2.13 added them; the *_tensor names above
    # call them inside torch, not through the wrapped module attribute: not counted twice).
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)


# Keys of the collectives in flight (StepTracker.pending); next() on it is atomic.
_tokens = itertools.count()


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def group_label(group: Any) -> str:
    """The name suffix for a collective on a sub-group ("" for the default group).

    Every member of a group computes the same label, so peers compare like with like.
    """
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return ""
    desc = getattr(group, "group_desc", "") or ""
    if desc and desc not in ("undefined", "default_pg"):
        return f"[{desc}]"
    try:
        return f"[size={group.size()}]"
    except Exception:
        return "[group]"


def _payload_bytes(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    if op == "barrier":
        return 0
    # The first positional argument is the tensor (or output list) for every op listed.
    first = args[0] if args else next(iter(kwargs.values()), None)
    if op in ("all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
              "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single"):
        # The output buffer: what every rank ends up moving in or out.
        return _nbytes(first) or _nbytes(args[1] if len(args) > 1 else None)
    return _nbytes(first)


def install_collective_hooks(att: Attachment) -> Uninstall:
    import torch.distributed as dist

    originals: dict[str, Callable[..., Any]] = {}
    for op in COLLECTIVES:
        fn = getattr(dist, op, None)
        if fn is None or getattr(fn, "__trainscope_original__", None) is not None:
            continue
        originals[op] = fn
        setattr(dist, op, _wrap(att, op, fn))
    att.original_all_reduce = originals.get("all_reduce", dist.all_reduce)
    uninstall_p2p = _p2p_ops_keep_the_originals()

    def uninstall() -> None:
        uninstall_p2p()
        for op, fn in originals.items():
            current = getattr(dist, op, None)
            if getattr(current, "__trainscope_original__", None) is fn:
                setattr(dist, op, fn)

    return uninstall


def _device_end(device: DeviceTimer, name: str, start_ns: int, start: Any, step: int) -> None:
    device.end(device.log(DEVICE_COLLECTIVE_LAYER, name), start_ns, start, step)


def _wrap(att: Attachment, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    measure = att.guard.wrap("collective hook", _describe)
    device_measure = att.guard.wrap("collective hook", _device_end)
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if compiling():
            return fn(*args, **kwargs)
        pending = att.steps.pending
        token = next(_tokens)
        start = pending[token] = time.time_ns()
        device = att.device
        step = att.steps.step
        device_start = device.begin_collective(step) if device is not None else None
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            pending.pop(token, None)
            if device_start is not None:
                device.abandon(device_start, step)  # type: ignore[union-attr]
            raise
        end = time.time_ns()
        described = measure(op, args, kwargs)
        if described is not None and result is not None and hasattr(result, "get_future"):
            # Asynchronous: an end event here would time the launch; it is recorded on
            # completion (see the module's docstring).
            _record_on_completion(att, described[0], start, described[1], result, token,
                                  device, device_start, step)
            return result
        pending.pop(token, None)
        if described is not None:
            att.record_collective(described[0], start, end - start, described[1])
            if device is not None:
                # A blocking call returns once the current stream waits for its completion:
                # from the stream reaching it to its end, on the device.
                device_measure(device, described[0], start, device_start, step)
        elif device_start is not None:
            device.abandon(device_start, step)  # type: ignore[union-attr]
        return result

    return HookedCollective(wrapper, fn)


class HookedCollective:
    """A ``torch.distributed`` function with our timing around it, **equal** to the function it
    wraps (and hashed alike): torch checks point-to-point ops by equality and membership,
    ``dist.P2POp(dist.isend, ...)`` (Megatron's and ``torch.distributed.pipelining``'s
    pipeline sends) refused any other callable, and a schedule tells sends from receives by
    ``{p.op for p in ops} == {dist.isend}``."""

    def __init__(self, call: Callable[..., Any], original: Callable[..., Any]) -> None:
        self._call = call
        self.__wrapped__ = original
        self.__trainscope_original__ = original
        self.__name__ = self.__qualname__ = getattr(original, "__name__", "collective")
        self.__doc__ = original.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        original = self.__trainscope_original__
        return other is self or other is original or getattr(
            other, "__trainscope_original__", None) is original

    def __hash__(self) -> int:
        return hash(self.__trainscope_original__)

    def __repr__(self) -> str:
        return f"<{self.__name__} of torch.distributed, timed by trainscope>"


def _p2p_ops_keep_the_originals() -> Uninstall:
    """``dist.P2POp`` built with our ``isend``/``irecv`` keeps torch's own: ``batch_isend_irecv``
    picks a send's or a receive's arguments by identity (``op.op is isend``). Sends and
    receives made through a P2POp run untimed."""
    import torch.distributed as dist

    from trainscope.producers.torch.hooks import replace_method

    p2p = getattr(dist, "P2POp", None)
    if p2p is None:
        return lambda: None
    original = p2p.__init__

    def init(self: Any, op: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        original(self, getattr(op, "__trainscope_original__", op), *args, **kwargs)

    return replace_method(p2p, "__init__", init)


def _describe(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
    group = kwargs.get("group")
    return op + group_label(group), _payload_bytes(op, args, kwargs)


def _record_on_completion(att: Attachment, name: str, start: int, nbytes: int, work: Any,
                          token: int, device: DeviceTimer | None = None,
                          device_start: Any = None, step: int = -1) -> None:
    try:
        future = work.get_future()
    except Exception:
        # Some backends' works have no future (e.g. p2p on older gloo): count issue time only.
        att.steps.pending.pop(token, None)
        att.record_collective(name, start, time.time_ns() - start, nbytes)
        if device is not None and device_start is not None:
            device.abandon(device_start, step)
        return

    def done(_future: Any) -> None:
        keep_thread_state()  # first: a backend thread (see threadstate); it never raises
        att.steps.pending.pop(token, None)
        try:
            if device is not None and device_start is not None:  # first: its event goes back
                # Queued on the callback's current stream, which torch synchronises with the
                # collective's kernels: the collective's end on the device.
                _device_end(device, name, start, device_start, step)
            att.record_collective(name, start, time.time_ns() - start, nbytes)
        except Exception as exc:
            att.guard.report("collective hook", exc)

    future.add_done_callback(done)


def install_ddp_comm_hook(att: Attachment, ddp: Any) -> bool:
    """Time DDP's bucket all-reduces; False when the model already has a comm hook."""
    import torch.distributed as dist

    all_reduce = att.original_all_reduce or dist.all_reduce
    all_reduce = getattr(all_reduce, "__trainscope_original__", all_reduce)

    def hook(process_group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        # Same arithmetic as DDP's default (divide, then sum-all-reduce) so results are unchanged.
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        pending = att.steps.pending
        token = next(_tokens)
        start = pending[token] = time.time_ns()
        tensor.div_(group.size())
        nbytes = tensor.numel() * tensor.element_size()
        device = att.device
        step = att.steps.step
        device_start = device.begin_collective(step) if device is not None else None
        try:
            future = all_reduce(tensor, group=group, async_op=True).get_future()
        except BaseException:
            pending.pop(token, None)
            if device is not None and device_start is not None:
                device.abandon(device_start, step)
            raise

        def done(fut: Any) -> torch.Tensor:
            keep_thread_state()  # first: a backend thread (see threadstate); it never raises
            pending.pop(token, None)
            try:
                if device is not None and device_start is not None:  # see _record_on_completion
                    _device_end(device, "ddp_allreduce", start, device_start, step)
                att.record_collective("ddp_allreduce", start, time.time_ns() - start, nbytes)
                att.on_ddp_allreduce(start, time.time_ns())
            except Exception as exc:
                att.guard.report("ddp comm hook", exc)
            return fut.value()[0]

        return future.then(done)

    # DDP validates the hook's annotations against dist.GradBucket/Future objects; with
    # postponed (string) annotations that check fails, so the hook presents none.
    hook.__annotations__ = {}
    try:
        ddp.register_comm_hook(None, hook)
    except RuntimeError as exc:
        att.guard.warn_once(
            "ddp comm hook",
            "trainscope: DDP gradient all-reduce not timed: %s (a comm hook is already set)",
            exc,
        )
        return False
    return True
