"""Call-path ids: the ``callpath_id`` of a :class:`FunctionSummary`, and the names it hashes.

A call path is the chain Python frame → op → kernel that led to an event; its id is a hash of the
parent's id, the layer and the name, so a kernel's id derives from the op that launched it. The
live profiler and the Kineto replay must compute it the same way for their summaries to merge,
so it is defined here, with the records.
"""

from __future__ import annotations

import hashlib
import re

# Ops, annotations and kernels of collectives: the ``collective`` layer, which detectors and the
# call-path diff take as waiting time. Shared by the live profiler and the trace ingestion, so
# both give an event the same layer (and call path).
_COLLECTIVE_PREFIXES = ("c10d::", "nccl:", "gloo:", "record_param_comms")

_ADDRESS = re.compile(r" (?:object )?at 0x[0-9a-fA-F]+")
_ID_MASK = (1 << 63) - 1  # ids stay positive in signed 64-bit columns (pandas, ClickHouse)


def callpath_id(parent: int, layer: str, name: str) -> int:
    digest = hashlib.blake2b(f"{parent}/{layer}/{name}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & _ID_MASK) or 1


def normalise_name(name: str) -> str:
    """Drop object addresses (``<built-in method sum of Tensor object at 0x7f..>``)."""
    return _ADDRESS.sub("", name)


def collective_or(layer: str, name: str) -> str:
    """``collective`` for the op, annotation or kernel of a collective, else ``layer``."""
    if layer in ("torch_op", "user_annotation") and name.startswith(_COLLECTIVE_PREFIXES):
        return "collective"
    if layer == "cuda_kernel" and name.lower().startswith("nccl"):
        return "collective"
    return layer


def enclosing_depth(stack: list[tuple[int, ...]], start_ns: int, end_ns: int) -> int:
    """Where an event [start_ns, end_ns) of one thread hangs in the call tree: ``stack`` holds
    the open events of that thread, outermost first, each starting with its end ns. Events
    that ended by ``start_ns`` are popped; the result is the index of the enclosing event, -1
    at the root. An event that ends after the innermost open one (clocks that disagree by a
    few ns) hangs under the innermost one that does enclose it. Live profiles and replayed
    traces nest by this one rule, so their call-path ids agree."""
    while stack and stack[-1][0] <= start_ns:
        stack.pop()
    depth = len(stack) - 1
    while depth >= 0 and stack[depth][0] < end_ns:
        depth -= 1
    return depth
