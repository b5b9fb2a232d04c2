"""Text and bytes from producers are data: how they are shown on a terminal and kept.

Job ids, function names, host names and whatever else a producer sends reach the operator's
terminal (``trainscope pipeline``'s ALERT lines, ``trainscope sql`` tables, the demo) and the
dead-letter table and topic. A producer (buggy or hostile) must not be able to move the cursor,
clear the screen, plant a hyperlink (OSC 8), ring the bell, overwrite a line with ``\\r`` or
forge another line with ``\\n``; and one huge bad message must not become a huge row.

- :func:`terminal_safe` writes every control character (C0, DEL, C1) and every invisible
  direction override as a visible escape (``\\x1b``, ``\\u202e``); printable text, other
  scripts included, is unchanged. Rich markup in data is the caller's to neutralise
  (``markup=False`` or ``rich.text.Text``), as only the caller knows it prints through Rich.
- :func:`bounded_payload` keeps at most :data:`DEAD_LETTER_PREFIX_BYTES` of a dead letter's
  payload, with the payload's full size and SHA-256, so the letter can still be matched with
  the producer's copy.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

# The part of a rejected message a dead letter keeps (in the table and on the topic).
DEAD_LETTER_PREFIX_BYTES = 64 * 1024

# C0 controls, DEL, C1 controls, and the bidirectional overrides/isolates and other invisible
# format characters that reorder or hide what a terminal shows.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: object) -> str:
    """``text`` (any value, as ``str()`` gives it) with every control or invisible format
    character written as a visible escape: safe to print, one line, still readable."""
    return _UNSAFE.sub(_escape, str(text))


@dataclass(frozen=True, slots=True)
class BoundedPayload:
    """What a dead letter keeps of a payload: its first bytes, its size and its digest."""

    prefix: bytes
    size_bytes: int
    sha256: str

    @property
    def truncated(self) -> bool:
        return len(self.prefix) < self.size_bytes

    def describe(self) -> str:
        """``payload 1048577 bytes sha256:… (first 65536 kept)``, for a key or a log line."""
        kept = f" (first {len(self.prefix)} kept)" if self.truncated else ""
        return f"payload {self.size_bytes} bytes sha256:{self.sha256}{kept}"


def bounded_payload(payload: bytes, limit_bytes: int = DEAD_LETTER_PREFIX_BYTES) -> BoundedPayload:
    return BoundedPayload(
        bytes(payload[:limit_bytes]), len(payload), hashlib.sha256(payload).hexdigest()
    )
