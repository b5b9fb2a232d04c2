"""NVML clocks-event ("throttle") reasons: the bits of the mask the sampler publishes as
``throttle_reasons``, and their names."""

from __future__ import annotations

# NVML clocks-event (formerly "throttle") reason bits, as in nvml.h.
THROTTLE_REASON_NAMES: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# The reasons that mean "slower than it could be" (idle, application or sync settings do not).
THROTTLING_MASK = 0x004 | 0x008 | 0x020 | 0x040 | 0x080


def decode_throttle_reasons(mask: int) -> list[str]:
    """Names of the bits set in an NVML clocks-event reason mask (unknown bits by value)."""
    names = [name for bit, name in THROTTLE_REASON_NAMES.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASON_NAMES)
    if unknown:
        names.append(f"unknown_{unknown:#x}")
    return names
