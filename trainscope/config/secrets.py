"""Keeping secrets out of messages: redacted URLs and scrubbed error texts.

Errors from client libraries may quote the address they were given, user info and all; every
message trainscope prints or logs about a connection goes through :func:`scrub` first.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

REDACTED = "***"


def url_has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return ":" in url.partition("@")[0] and "@" in url


def redact_url(url: str) -> str:
    """``scheme://user:pw@host/x`` → ``scheme://user:***@host/x``; other URLs unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED if "@" in url else url
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:{REDACTED}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every occurrence of each non-empty secret replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text
