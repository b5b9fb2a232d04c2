"""Nothing inside trainscope may raise into the training loop.

Every hook body runs behind a :class:`Guard`: an exception is caught, counted by kind and
logged once per kind (a hook that fails every step must not flood the training log).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger("trainscope")

F = TypeVar("F", bound=Callable[..., Any])


class Guard:
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self._warned: set[str] = set()
        # Re-entrant: a failing GC callback reports from inside whatever allocation started the
        # collection, which may be this very thread counting another failure.
        self._lock = threading.RLock()

    def report(self, kind: str, exc: BaseException) -> None:
        with self._lock:
            self.errors[kind] += 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            log.warning(
                "trainscope: %s failed (%s: %s); training continues, further failures of this "
                "kind are only counted",
                kind,
                type(exc).__name__,
                exc,
            )

    def warn_once(self, kind: str, message: str, *args: object) -> None:
        """A condition worth one line in the log (not an error)."""
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning(message, *args)

    def wrap(self, kind: str, fn: F, default: Any = None) -> F:
        """``fn`` that returns ``default`` instead of raising."""

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                self.report(kind, exc)
                return default

        return guarded  # type: ignore[return-value]

    def total(self) -> int:
        with self._lock:
            return sum(self.errors.values())

    def reset_after_fork(self) -> None:
        # The lock may have been held by another thread at fork time.
        self._lock = threading.RLock()
