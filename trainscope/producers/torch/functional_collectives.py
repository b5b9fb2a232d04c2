"""Timing of functional collectives: tensor parallelism through DTensor, and any script's own.

DTensor (``parallelize_module``'s ``ColwiseParallel``/``RowwiseParallel``, FSDP2 with tensor
parallelism) communicates through ``torch.distributed._functional_collectives``, not the
``torch.distributed`` functions :mod:`trainscope.producers.torch.collectives` hooks: a
collective is issued (``all_reduce``, ``all_gather_single``, ...) and returns at once with an
``AsyncCollectiveTensor``; the rank waits for it where the result is first used
(``wait_tensor``). Both are module functions called through the module, so both are wrapped
there: the issue notes the collective's name, start and bytes under the id of the tensor it
will wait on (by its storage: torch waits on a view of it as often as on the tensor), the
wait ends its span (what the rank its peers wait on waits least for, as with
any collective). A collective never waited on is not recorded; at most ``MAX_IN_FLIGHT`` are
kept (the oldest go first). Under ``torch.compile`` the originals run: the compiler maps them
to its own ops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainscope.producers.torch.collectives import HookedCollective, group_label

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

# What DTensor and the functional API's users call (torch 2.13); a name a torch lacks is skipped.
ISSUES = (
    "all_reduce",
    "all_gather_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all_single",
)
MAX_IN_FLIGHT = 4096

InFlight = tuple[str, int, int, int]  # name, start ns, bytes, token of StepTracker.pending


def install_functional_collective_hooks(att: Attachment) -> Callable[[], None]:
    import torch

    from trainscope.producers.torch.collectives import _tokens

    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:  # a torch built without distributed
        return lambda: None
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)
    in_flight: dict[int, InFlight] = {}
    pending = att.steps.pending
    originals: dict[str, Callable[..., Any]] = {}

    def issue(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def issued(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                return fn(*args, **kwargs)
            start = time.time_ns()
            out = fn(*args, **kwargs)
            try:
                waited_on = getattr(out, "elem", None)
                if waited_on is None or getattr(out, "completed", True):
                    att.record_collective(_name(op, args, kwargs), start,
                                          time.time_ns() - start, _nbytes(out))
                    return out
                if len(in_flight) >= MAX_IN_FLIGHT:
                    del in_flight[next(iter(in_flight))]
                token = next(_tokens)
                pending[token] = start
                in_flight[_storage(waited_on)] = (_name(op, args, kwargs), start, _nbytes(out),
                                                  token)
            except Exception as exc:
                att.guard.report("functional collective hook", exc)
            return out

        return issued

    wait_original = funcol.wait_tensor

    def wait_tensor(tensor: Any) -> Any:
        out = wait_original(tensor)
        if in_flight and not compiling():
            noted = in_flight.pop(_storage(tensor), None)
            if noted is not None:
                name, start, nbytes, token = noted
                pending.pop(token, None)
                try:
                    att.record_collective(name, start, time.time_ns() - start, nbytes)
                except Exception as exc:
                    att.guard.report("functional collective hook", exc)
        return out

    for op in ISSUES:
        fn = getattr(funcol, op, None)
        if fn is None or getattr(fn, "__trainscope_original__", None) is not None:
            continue
        originals[op] = fn
        setattr(funcol, op, HookedCollective(issue(op, fn), fn))
    if getattr(wait_original, "__trainscope_original__", None) is None:
        originals["wait_tensor"] = wait_original
        # The async tensor's own wait calls the module's wait_tensor: hooked there too.
        funcol.wait_tensor = HookedCollective(wait_tensor, wait_original)

    def uninstall() -> None:
        for op, fn in originals.items():
            if getattr(getattr(funcol, op, None), "__trainscope_original__", None) is fn:
                setattr(funcol, op, fn)
        for token in [t for _, _, _, t in in_flight.values()]:
            pending.pop(token, None)
        in_flight.clear()

    return uninstall


# Where each op takes its group, positionally (its keyword is ``group``).
_GROUP_ARG = {"all_reduce": 2, "all_gather_tensor": 2, "all_gather_single": 2,
              "reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "all_to_all_single": 3}


def _name(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``op`` and its group's label, as the torch.distributed collectives are named."""
    at = _GROUP_ARG[op]
    group = kwargs.get("group", args[at] if len(args) > at else None)
    return op + _group_suffix(group)


def _group_suffix(group: Any) -> str:
    """The label of the process group a functional collective names: a group, a mesh (its
    first dimension), a (mesh, dimension) pair, a group's registered name or a list of ranks."""
    import torch.distributed as dist

    try:
        if isinstance(group, tuple):
            return group_label(group[0].get_group(group[1]))
        if hasattr(group, "get_group"):
            return group_label(group.get_group(0))
        if isinstance(group, str):
            from torch.distributed.distributed_c10d import _resolve_process_group

            return group_label(_resolve_process_group(group))
        if isinstance(group, list):
            return f"[size={len(group)}]"
        return group_label(group if isinstance(group, dist.ProcessGroup) else None)
    except Exception:
        return "[group]"


def _storage(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # no storage (a fake or meta tensor): never waited on as noted
        return -1


def _nbytes(out: Any) -> int:
    tensor = getattr(out, "elem", out)
    try:
        return int(tensor.numel() * tensor.element_size())
    except Exception:
        return 0
