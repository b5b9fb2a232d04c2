"""``attach()`` and ``step()``: the two functions a training script calls.

One attachment per process; ``attach()`` is idempotent and returns the existing one. A forked
child (a DataLoader worker) inherits the hooks but its attachment is switched off at fork.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from types import TracebackType
from typing import Any

from trainscope.config import env
from trainscope.producers.torch.options import disabled, resolve
from trainscope.producers.torch.runtime import Attachment, set_log_level
from trainscope.producers.torch.safety import log

_lock = threading.Lock()
_current: Attachment | None = None
_fork_handler_installed = False


def attach(**options: Any) -> Attachment | None:
    """Start observing this training process; returns the handle (``.stats()``, ``.detach()``).

    Options (each also settable by its environment variable, see :mod:`trainscope.config.env`):
    ``bus`` (URL or a Bus object), ``job_id``, ``rank``, ``world_size``, ``local_rank``,
    ``host``, ``window_s``, ``queue_size``, ``profile_budget_s``, ``profile_max_steps``,
    ``optrace``, ``pp_size``, ``tp_size``; ``device_events``, a function returning a new
    timing event (default: ``torch.cuda.Event`` once a top model's input is on a CUDA
    device; see :mod:`trainscope.producers.torch.device_timing`). Bad option values raise
    ``ValueError`` here, at attach time; after that nothing trainscope does raises into
    training.
    Returns None when disabled by ``TRAINSCOPE_DISABLE``.
    """
    global _current, _fork_handler_installed
    set_log_level(os.environ.get(env.TRAINSCOPE_LOG_LEVEL))
    if disabled():
        log.info("trainscope: disabled by %s", env.TRAINSCOPE_DISABLE)
        return None
    _require_torch()
    with _lock:
        if _current is not None and _current.active and _current._pid == os.getpid():
            return _current
        bus = options.pop("bus", None)
        device_events = options.pop("device_events", None)
        resolved = resolve(**options)
        attachment = Attachment(resolved, bus, device_events)
        attachment.on_detach = forget
        _current = attachment
        if not _fork_handler_installed:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            # The sender's threads are daemons: without this a script that never detaches
            # (the README's) lost its last round of steps and its open windows at exit.
            atexit.register(_detach_at_exit)
            _fork_handler_installed = True
    attachment.start()
    return attachment


TORCH_MISSING = "trainscope.attach() needs PyTorch in this environment: pip install torch"


def _require_torch() -> None:
    """Fail at attach time, in one line, where torch is not installed.

    Without this the import error would come from deep inside the hooks, after the sender had
    started. ``name`` is kept so the CLI's missing-extra table recognises it.
    """
    try:
        import torch  # noqa: F401  (the training script's own; already imported there)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "torch":
            raise  # torch is there but one of its own dependencies is not: its error says which
        raise ImportError(TORCH_MISSING, name="torch") from None


def current() -> Attachment | None:
    att = _current
    return att if att is not None and att.active else None


def forget(attachment: Attachment) -> None:
    global _current
    with _lock:
        if _current is attachment:
            _current = None


EXIT_FLUSH_S = 5.0  # the longest the process's exit waits for the bus


def _detach_at_exit() -> None:
    """At interpreter exit (atexit runs before daemon threads stop): detach the attachment
    still active in this process, sending what is left for up to ``EXIT_FLUSH_S``."""
    att = _current
    if att is not None and att.active and att._pid == os.getpid():
        try:
            att.detach(timeout_s=EXIT_FLUSH_S)
        except Exception as exc:
            att.guard.report("detach at exit", exc)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    if _current is not None:
        _current.after_fork_in_child()


class step:
    """Marks one training step for loops without an optimizer (or to pass samples/tokens).

    Once used, these blocks — not optimizer steps — define step boundaries. A no-op when
    trainscope is not attached.
    """

    __slots__ = ("samples", "tokens")

    def __init__(self, samples: int | None = None, tokens: int | None = None) -> None:
        self.samples = samples
        self.tokens = tokens

    def __enter__(self) -> step:
        att = _current
        if att is not None and att.active:
            try:
                att.begin_explicit_step()
            except Exception as exc:
                att.guard.report("step", exc)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        att = _current
        if att is not None and att.active:
            try:
                att.end_step(time.time_ns(), self.samples, self.tokens)
            except Exception as error:
                att.guard.report("step", error)
