"""Digests of upstream functions' source, for the tests that pin our adapters to private APIs.

An adapter (``faust_private``, ``aiokafka_private``) records, for each upstream function that our
code copies, replaces or relies on, the digest of its source as it was when the adapter was
written. :func:`changed_functions` recomputes them from the installed library. The source is
normalised first: comments, blank lines and the width of indentation do not count, everything
else (docstrings included) does.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import textwrap
import tokenize
from collections.abc import Callable, Mapping
from typing import Any


def normalised(source: str) -> str:
    """``source`` as its tokens, without comments, blank lines or indentation widths."""
    kept = []
    for token in tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER):
            continue
        if token.type == tokenize.INDENT:
            kept.append("<indent>")
        elif token.type == tokenize.DEDENT:
            kept.append("<dedent>")
        elif token.type == tokenize.NEWLINE:
            kept.append("<newline>")
        else:
            kept.append(token.string)
    return " ".join(kept)


def source_digest(source: str) -> str:
    return hashlib.sha256(normalised(source).encode()).hexdigest()[:16]


def resolve(name: str) -> Any:
    """``"module:Class.function"`` → the function defined there (not inherited: a method that
    moved to another class counts as changed), unwrapped from its decorators."""
    module_name, _, qualname = name.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        found = vars(found)[part]
    if isinstance(found, staticmethod | classmethod):
        found = found.__func__
    elif isinstance(found, property):
        found = found.fget
    found = getattr(found, "fun", found)  # mode's @Service.task keeps the coroutine here
    return inspect.unwrap(found)


def upstream_source(name: str) -> str:
    return inspect.getsource(resolve(name))


def changed_functions(
    recorded: Mapping[str, str], read_source: Callable[[str], str] = upstream_source
) -> list[str]:
    """One line per function whose source no longer has the ``recorded`` digest: its name, its
    digest now (or why there is none) and the recorded one."""
    changed = []
    for name, digest in recorded.items():
        try:
            now = source_digest(read_source(name))
        except (ImportError, KeyError, OSError, TypeError) as exc:
            changed.append(f"{name}: not found ({type(exc).__name__}: {exc})")
            continue
        if now != digest:
            changed.append(f"{name}: digest now {now!r}, recorded {digest!r}")
    return changed


def report(library: str, expected: str, installed: str, adapter: str, changed: list[str]) -> str:
    return (
        f"{library} {installed} is installed; {adapter} was written against {expected}. "
        f"Upstream functions that changed since:\n  " + "\n  ".join(changed) + "\n"
        f"Read each against our code (see the comment above its entry in {adapter}), then "
        f"record its digest now in UPSTREAM_DIGESTS and move the pin in pyproject.toml."
    )
