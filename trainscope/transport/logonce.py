"""A logging filter that lets the first of a run of repeated messages through, then stays quiet.

A stream job outlives outages of what it talks to; the Kafka client logs every failed
reconnect, metadata refresh and commit retry (hundreds of lines a minute). The operator needs to
know that it started, that it goes on, and when it stopped: the first line of each kind, then
one line per ``interval_s`` saying how many were held back.
"""

from __future__ import annotations

import logging
import time


class RepeatFilter(logging.Filter):
    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[tuple[str, object], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        # The unformatted message: one key per kind of message, whatever its arguments.
        key = (record.name, record.msg)
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is None:
            self._last[key] = (now, 0)
            return True
        since, held = seen
        if now - since < self.interval_s:
            self._last[key] = (since, held + 1)
            return False
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} like it in the last {now - since:.0f} s)"
        return True


def quiet_repeats(interval_s: float = 60.0) -> None:
    """Install :class:`RepeatFilter` on the root logger's handlers."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter(interval_s))
