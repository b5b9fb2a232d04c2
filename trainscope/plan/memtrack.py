"""Count the bytes a piece of PyTorch code keeps alive, without a GPU.

A ``TorchDispatchMode`` sees every tensor an operator returns; each distinct storage is counted
once when it first appears and uncounted when Python frees it (a weak reference to the storage
object, which PyTorch keeps unique per storage). On the meta device no data is ever allocated,
so a model of any size can be counted on a laptop. Storages made before the mode was entered
(parameters, say) are added with :meth:`MemoryTracker.adopt`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class MemoryTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, weakref.ref[Any]] = {}

    def adopt(self, tensors: Any) -> None:
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs:
            return
        size = storage.nbytes()
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

        def freed(_ref: Any, key: int = key, size: int = size) -> None:
            self.live_bytes -= size
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, freed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out
