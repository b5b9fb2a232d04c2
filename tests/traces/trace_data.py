"""Where the recorded traces kept with the tests are (a module of its own: test modules import
it by name, and ``conftest`` is a name several test directories share)."""

from __future__ import annotations

from pathlib import Path

H100 = Path(__file__).resolve().parent.parent / "data" / "kineto-cuda-h100"
# The two-block transformer: every event class, launch-bound.
H100_TRACES = [H100 / "cuda-plain.json.gz", H100 / "vm_432.1795365115932599276.pt.trace.json.gz"]
# An MLP step that copies its batch from pageable memory and calls .item() 20 times, and the
# same step with a pinned, non-blocking copy and no .item().
H100_PAGEABLE = H100 / "cuda-pageable-item.json.gz"
H100_PINNED = H100 / "cuda-pinned.json.gz"
ALL_H100 = sorted(H100.glob("*.json.gz"))
