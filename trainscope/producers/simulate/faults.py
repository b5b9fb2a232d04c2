"""Fault specs for the simulated cluster: ``KIND[:KEY=VALUE,...]``.

Examples: ``slow-gpu:rank=13,factor=1.4``, ``gc-pause:rank=2,ms=300,every=5,start=40``,
``stage-imbalance:stage=3,factor=1.3``, ``seq-imbalance``. Every fault accepts ``start=STEP``
(default 0), the first step it affects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainscope.schemas.errors import TrainscopeError


class FaultSpecError(ValueError, TrainscopeError):
    """A fault spec that cannot be understood; the text names the spec and the problem."""


@dataclass(frozen=True)
class _Param:
    kind: type
    default: float | int | None = None  # None: required

    def parse(self, raw: str) -> float | int:
        try:
            return self.kind(raw)
        except ValueError:
            expected = "an integer" if self.kind is int else "a number"
            raise ValueError(f"expected {expected}") from None


_KINDS: dict[str, dict[str, _Param]] = {
    "slow-gpu": {"rank": _Param(int), "factor": _Param(float, 1.5)},
    "throttle": {"rank": _Param(int), "mhz": _Param(float, 1200.0)},
    "slow-link": {"rank": _Param(int), "factor": _Param(float, 3.0)},
    "dataloader-stall": {"rank": _Param(int), "ms": _Param(float, 200.0)},
    "gc-pause": {"rank": _Param(int), "ms": _Param(float, 300.0), "every": _Param(int, 5)},
    "stage-imbalance": {"stage": _Param(int), "factor": _Param(float, 1.3)},
    "seq-imbalance": {"spread": _Param(float, 0.4)},
}
KINDS = tuple(_KINDS)


@dataclass(frozen=True)
class Fault:
    kind: str
    start: int = 0
    params: dict[str, float | int] = field(default_factory=dict)

    def __getitem__(self, key: str) -> float | int:
        return self.params[key]

    def active(self, step: int) -> bool:
        return step >= self.start

    def __str__(self) -> str:
        parts = [f"{k}={v:g}" for k, v in self.params.items()]
        if self.start:
            parts.append(f"start={self.start}")
        return self.kind + (":" + ",".join(parts) if parts else "")


def parse_fault(spec: str) -> Fault:
    kind, _, rest = spec.strip().partition(":")
    if kind not in _KINDS:
        raise FaultSpecError(
            f"unknown fault kind {kind!r} in {spec!r}; known kinds: {', '.join(KINDS)}"
        )
    schema = _KINDS[kind]
    given: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise FaultSpecError(f"bad parameter {item!r} in {spec!r}: expected KEY=VALUE")
        if key != "start" and key not in schema:
            known = ", ".join([*schema, "start"])
            raise FaultSpecError(
                f"unknown parameter {key!r} for {kind} in {spec!r}; known: {known}"
            )
        given[key] = value
    params: dict[str, float | int] = {}
    for key, param in schema.items():
        if key not in given:
            if param.default is None:
                raise FaultSpecError(f"fault {kind} needs {key}=... (in {spec!r})")
            params[key] = param.default
            continue
        try:
            params[key] = param.parse(given[key])
        except ValueError as exc:
            raise FaultSpecError(f"bad value {key}={given[key]!r} in {spec!r}: {exc}") from None
    try:
        start = int(given.get("start", "0"))
    except ValueError:
        raise FaultSpecError(f"bad value start={given['start']!r} in {spec!r}") from None
    fault = Fault(kind=kind, start=start, params=params)
    _check_ranges(fault, spec)
    return fault


def _check_ranges(fault: Fault, spec: str) -> None:
    for key, value in fault.params.items():
        if key in ("rank", "stage") and value < 0:
            raise FaultSpecError(f"{key} must be >= 0 in {spec!r}")
        if key in ("factor",) and value < 1.0:
            raise FaultSpecError(f"factor must be >= 1 (a slowdown) in {spec!r}")
        if key in ("ms", "mhz", "spread") and value <= 0:
            raise FaultSpecError(f"{key} must be > 0 in {spec!r}")
        if key == "every" and value < 1:
            raise FaultSpecError(f"every must be >= 1 in {spec!r}")
    if fault.start < 0:
        raise FaultSpecError(f"start must be >= 0 in {spec!r}")


def parse_faults(specs: list[str] | tuple[str, ...]) -> list[Fault]:
    return [parse_fault(s) for s in specs]
