"""A step that the loss scaler skips still ends.

With mixed precision, ``GradScaler.step(optimizer)`` does not call ``optimizer.step()`` when
the scaled gradients hold an inf or a NaN (the scale is too high: during the first steps, and
again whenever it has grown too far). The step boundary is the pacing optimizer's step
(:mod:`~trainscope.producers.torch.steps`), so a skipped step and the next one became one step
record twice as long, and the job's step numbers fell behind its iterations. The scaler's
``step`` is wrapped (on the class, as the data loader's ``__next__`` is): when it returns
without the optimizer having stepped, the step ends there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainscope.producers.torch.hooks import end_step_if_pacing, replace_method

if TYPE_CHECKING:
    from trainscope.producers.torch.runtime import Attachment


def install_grad_scaler_hook(att: Attachment) -> Callable[[], None]:
    try:
        from torch.amp.grad_scaler import GradScaler as cls  # torch >= 2.3
    except ImportError:  # older torch: the CUDA scaler is the only one
        from torch.cuda.amp.grad_scaler import GradScaler as cls  # type: ignore[no-redef]

    original = cls.step
    steps = att.steps
    report = att.guard.report

    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        ended = steps.step
        try:
            return original(self, optimizer, *args, **kwargs)
        finally:
            try:
                if steps.step == ended and att.active and not steps.explicit:
                    end_step_if_pacing(att, optimizer, time.time_ns())  # skipped: no hook ran
            except Exception as exc:
                report("grad scaler hook", exc)

    return replace_method(cls, "step", step)
