"""Checks of detector constructor arguments: a bad setting fails at construction, in one line.

A threshold of -1 or a window count of 0 would not crash a detector; it would silently make it
report everything or nothing. So every built-in checks its arguments when it is built, with
``DetectorConfigError: peer-diff: z_min must be > 0, got -1``.
"""

from __future__ import annotations

import math

from trainscope.schemas.errors import TrainscopeError


class DetectorConfigError(ValueError, TrainscopeError):
    """A detector was given an argument outside its valid range."""


def check_number(
    detector: str,
    name: str,
    value: object,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    integer: bool = False,
) -> None:
    """Raise DetectorConfigError unless ``value`` is a finite number (an int if ``integer``)
    within the given bounds."""
    kind = "an integer" if integer else "a number"
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):  # type: ignore[arg-type]
        raise DetectorConfigError(f"{detector}: {name} must be {kind}, got {value!r}")
    number = float(value)  # type: ignore[arg-type]
    low = f"> {gt:g}" if gt is not None else f">= {ge:g}" if ge is not None else None
    high = f"< {lt:g}" if lt is not None else f"<= {le:g}" if le is not None else None
    bad = (
        (gt is not None and not number > gt)
        or (ge is not None and not number >= ge)
        or (lt is not None and not number < lt)
        or (le is not None and not number <= le)
    )
    if bad:
        bounds = " and ".join(b for b in (low, high) if b)
        raise DetectorConfigError(f"{detector}: {name} must be {bounds}, got {value!r}")


def check_order(detector: str, low_name: str, low: float, high_name: str, high: float) -> None:
    """Raise DetectorConfigError unless ``low < high`` (e.g. the z that starts an alert and the
    z at which it is certain)."""
    if not low < high:
        raise DetectorConfigError(
            f"{detector}: {low_name} must be < {high_name}, got {low!r} and {high!r}"
        )
