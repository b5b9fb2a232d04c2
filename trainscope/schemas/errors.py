"""The one root of trainscope's own exceptions.

Every error trainscope raises on purpose derives from :class:`TrainscopeError` as well as from the
built-in class it always had (``ValueError``, ``RuntimeError``, ``LookupError``), so callers can
catch everything of ours in one clause while existing ``except ValueError`` code keeps working.
"""

from __future__ import annotations


class TrainscopeError(Exception):
    """Base class of the errors trainscope raises on purpose."""
