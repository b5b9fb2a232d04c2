"""NVML clocks-event ("throttle") reasons: the bits of the mask the sampler publishes as
``throttle_reasons``, and their names (defined with the metric vocabulary, which detectors share).
"""

from __future__ import annotations

from trainscope.schemas.metrics import THROTTLE_REASON_NAMES
from trainscope.schemas.metrics import THROTTLING_REASONS_MASK as THROTTLING_MASK

__all__ = ["THROTTLE_REASON_NAMES", "THROTTLING_MASK", "decode_throttle_reasons"]


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the bits set in an NVML clocks-event reason mask (unknown bits by value)."""
    names = [name for bit, name in THROTTLE_REASON_NAMES.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASON_NAMES)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names
