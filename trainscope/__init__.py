"""trainscope: online performance troubleshooting for large-model training.

Importing this package is cheap: it pulls in neither torch nor the stream-processing stack.
``trainscope.attach()`` imports torch (the user's own) only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment

__all__ = ["__version__", "attach", "step"]


def attach(**options: Any) -> Attachment | None:
    """Observe this PyTorch training process; see :func:`trainscope.producers.torch.attach`."""
    from trainscope.producers.torch.api import attach as _attach

    return _attach(**options)


def step(samples: int | None = None, tokens: int | None = None) -> Any:
    """``with trainscope.step(): ...`` marks one training step (no-op when not attached)."""
    from trainscope.producers.torch.api import step as _step

    return _step(samples, tokens)
