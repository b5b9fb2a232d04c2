"""Event classes of Kineto/Chrome traces: their spellings, old and new, and their layers.

A trace's complete events (``ph: X``) carry a category (``cat``). Current Kineto writes
``python_function``, ``user_annotation``, ``gpu_user_annotation``, ``cpu_op``,
``cuda_runtime``, ``cuda_driver``, ``kernel``, ``gpu_memcpy`` and ``gpu_memset``; traces of
torch 1.8–1.10 spell some of them ``Operator``, ``Kernel``, ``Runtime``, ``Memcpy``,
``Memset`` (any capitalisation is accepted). Each class becomes one ``layer`` of the function
summaries; collectives (NCCL kernels, ``c10d::``/``nccl:``/``gloo:`` ops and annotations) go
to the ``collective`` layer instead, which the detectors treat as waiting time.
"""

from __future__ import annotations

from trainscope.schemas.callpath import collective_or

# Canonical class names, in the order reports list them.
CLASSES = (
    "python_function",
    "user_annotation",
    "gpu_user_annotation",
    "cpu_op",
    "cuda_runtime",
    "cuda_driver",
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
)
CLASS_INDEX = {name: i for i, name in enumerate(CLASSES)}

# Lower-cased category → canonical class: current spellings and the older ones.
_SPELLINGS = {
    **{name: name for name in CLASSES},
    "python": "python_function",
    "operator": "cpu_op",
    "runtime": "cuda_runtime",
    "driver": "cuda_driver",
    "memcpy": "gpu_memcpy",
    "memset": "gpu_memset",
}

CLASS_LAYER = {
    "python_function": "python",
    "user_annotation": "user_annotation",
    "gpu_user_annotation": "gpu_user_annotation",
    "cpu_op": "torch_op",
    "cuda_runtime": "cuda_api",
    "cuda_driver": "cuda_api",
    "kernel": "cuda_kernel",
    "gpu_memcpy": "memcpy",
    "gpu_memset": "memcpy",
}
# Classes that run on a device timeline (a GPU stream), not on a host thread.
DEVICE_CLASSES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
RUNTIME_CLASSES = frozenset({"cuda_runtime", "cuda_driver"})

# Flow events (``ph`` s/t/f) that link a runtime call to the device work it launched.
LAUNCH_FLOW_CATEGORIES = frozenset({"ac2g", "async_gpu"})
# Complete events the profiler writes about itself rather than about the program.
PROFILER_CATEGORIES = frozenset({"trace", "overhead"})

def event_class(category: str) -> str | None:
    """The canonical class of a complete event's category, ``None`` if it is not one."""
    return _SPELLINGS.get(category.lower())


def layer_of(event_class_name: str, name: str) -> str:
    """The summary layer of an event of a known class."""
    return collective_or(CLASS_LAYER[event_class_name], name)
