"""The NVML sampler: GPU state per device and GPU use per training process.

The NVML module is a constructor parameter (default: ``pynvml`` from ``nvidia-ml-py``, imported
when the sampler starts), so tests pass a stand-in and nothing is patched globally.

Per device, each interval: SM/memory utilisation, SM/memory clocks and the SM maximum, clock
event (throttle) reasons as a bitmask (:func:`decode_throttle_reasons` names the bits), power and
its enforced limit, temperature, memory used/total, PCIe TX/RX throughput and replay counter,
NVLink throughput and error counters. Per process: GPU utilisation and memory, attributed to the
process's job and rank (from its environment, see :mod:`.procinfo`). Device metrics carry the
rank of the one training process on the device, when there is exactly one. ECC and XID errors
arrive through an NVML event set polled without blocking.

A field the device does not support (or this driver/library does not have) is skipped from then
on — NVML calls cost a few to a few hundred microseconds and would fail the same way each time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainscope.producers.agent import procinfo
from trainscope.producers.agent.base import (
    NO_GPU,
    NO_NVML_LIBRARY,
    CollectorStats,
    CollectorUnavailable,
)
from trainscope.schemas import metrics as m
from trainscope.schemas.records import MetricSample

log = logging.getLogger(__name__)

_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED
_NOT_FOUND = 6  # NVML_ERROR_NOT_FOUND
_TIMEOUT = 10  # NVML_ERROR_TIMEOUT
_LIBRARY_NOT_FOUND = 12  # NVML_ERROR_LIBRARY_NOT_FOUND
_FUNCTION_NOT_FOUND = 13  # NVML_ERROR_FUNCTION_NOT_FOUND
_DRIVER_NOT_LOADED = 9  # NVML_ERROR_DRIVER_NOT_LOADED

# Field ids of nvmlDeviceGetFieldValues (nvml.h).
_FI_NVLINK_CRC_DATA_ERRORS_TOTAL = 45
_FI_NVLINK_REPLAY_ERRORS_TOTAL = 52
_FI_NVLINK_RECOVERY_ERRORS_TOTAL = 59
_FI_NVLINK_LINK_COUNT = 91
_FI_NVLINK_THROUGHPUT_TX_KIB = 138
_FI_NVLINK_THROUGHPUT_RX_KIB = 139

_EVENT_SINGLE_BIT_ECC = 0x1
_EVENT_DOUBLE_BIT_ECC = 0x2
_EVENT_XID = 0x8
_MAX_EVENTS_PER_INTERVAL = 1000  # bounded: an event storm cannot stall the agent


def _error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


@dataclass
class _Device:
    index: int
    handle: Any
    last_process_ts_us: int = 0
    nvlinks: list[int] = field(default_factory=list)
    nvlink_prev: tuple[int, int, int] | None = None  # (tx KiB, rx KiB, sample time ns)


class NvmlSampler:
    """Collector of NVML metric samples; see the module docstring."""

    name = "nvml"

    def __init__(
        self,
        nvml: Any = None,
        *,
        host: str = "",
        default_job_id: str = "unknown",
        proc_root: Path = Path("/proc"),
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.nvml = nvml
        self.host = host
        self.default_job_id = default_job_id
        self.proc_root = proc_root
        self.clock_ns = clock_ns
        self.stats = CollectorStats()
        self.unsupported: set[tuple[int, str]] = set()  # (device index, field)
        self._devices: list[_Device] = []
        self._identities = procinfo.IdentityCache(default_job_id, proc_root)
        self._event_set: Any = None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self.nvml is None:
            try:
                import pynvml  # from nvidia-ml-py
            except ImportError:
                raise CollectorUnavailable(
                    NO_NVML_LIBRARY,
                    "NVML Python bindings are not installed (pip install nvidia-ml-py, or the "
                    "trainscope[host] extra)",
                ) from None
            self.nvml = pynvml
        nv = self.nvml
        try:
            nv.nvmlInit()
        except Exception as exc:
            code = _error_code(exc)
            if code == _LIBRARY_NOT_FOUND:
                raise CollectorUnavailable(
                    NO_NVML_LIBRARY,
                    "no NVIDIA driver: the NVML library (libnvidia-ml.so.1) was not found",
                ) from None
            if code == _DRIVER_NOT_LOADED:
                raise CollectorUnavailable(
                    NO_GPU, "no GPU: the NVIDIA driver is not loaded"
                ) from None
            raise CollectorUnavailable(NO_GPU, f"NVML failed to initialise: {exc}") from None
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            nv.nvmlShutdown()
            raise CollectorUnavailable(NO_GPU, "no GPU: NVML reports 0 devices")
        self._devices = [_Device(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        for device in self._devices:
            device.nvlinks = self._active_nvlinks(device)
        self._register_events()

    def stop(self, window_start_ns: int, window_end_ns: int) -> list[MetricSample]:
        nv, self._devices = self.nvml, []
        if nv is not None:
            if self._event_set is not None:
                self._quiet(lambda: nv.nvmlEventSetFree(self._event_set))
                self._event_set = None
            self._quiet(nv.nvmlShutdown)
        return []

    # -- one interval -------------------------------------------------------------------------
    def collect(self, window_start_ns: int, window_end_ns: int) -> list[MetricSample]:
        ts_ns = self.clock_ns()
        out: list[MetricSample] = []
        for device in self._devices:
            processes = self._process_samples(device, ts_ns)
            owners = {(s.job_id, s.rank) for s in processes if s.rank >= 0}
            job_id, rank = owners.pop() if len(owners) == 1 else (self.default_job_id, -1)
            for name, value in self._device_values(device, ts_ns):
                out.append(
                    MetricSample(
                        job_id=job_id,
                        host=self.host,
                        rank=rank,
                        device=device.index,
                        ts_ns=ts_ns,
                        name=name,
                        value=value,
                    )
                )
            out.extend(processes)
        out.extend(self._poll_events(ts_ns))
        self.stats.samples += len(out)
        return out

    def _device_values(self, device: _Device, ts_ns: int) -> list[tuple[str, float]]:
        nv, h, values = self.nvml, device.handle, []

        def read(key: str, fn: Callable[[], Any]) -> Any:
            return self._read(device, key, fn)

        util = read("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            values += [(m.SM_UTIL_PCT, util.gpu), (m.MEM_UTIL_PCT, util.memory)]
        simple: list[tuple[str, str, Callable[[], Any], float]] = [
            ("sm_clock", m.SM_CLOCK_MHZ, lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1),
            (
                "sm_clock_max",
                m.SM_CLOCK_MAX_MHZ,
                lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
                1,
            ),
            (
                "mem_clock",
                m.MEM_CLOCK_MHZ,
                lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                1,
            ),
            ("throttle_reasons", m.THROTTLE_REASONS, lambda: self._throttle_reasons(h), 1),
            ("power", m.POWER_W, lambda: nv.nvmlDeviceGetPowerUsage(h), 1e-3),  # mW
            ("power_limit", m.POWER_LIMIT_W, lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h), 1e-3),
            (
                "temperature",
                m.TEMPERATURE_C,
                lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                1,
            ),
            (
                "pcie_tx",
                m.PCIE_TX_BYTES_PER_S,
                lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES),
                1024,
            ),  # KB/s
            (
                "pcie_rx",
                m.PCIE_RX_BYTES_PER_S,
                lambda: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES),
                1024,
            ),
            ("pcie_replay", m.PCIE_REPLAY_COUNT, lambda: nv.nvmlDeviceGetPcieReplayCounter(h), 1),
        ]
        for key, name, fn, scale in simple:
            value = read(key, fn)
            if value is not None:
                values.append((name, float(value) * scale))
        memory = read("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if memory is not None:
            values += [
                (m.MEM_USED_BYTES, float(memory.used)),
                (m.MEM_TOTAL_BYTES, float(memory.total)),
            ]
        if device.nvlinks:
            values += self._nvlink_values(device, ts_ns)
        return values

    def _throttle_reasons(self, handle: Any) -> int:
        nv = self.nvml
        # Renamed from "throttle reasons" in newer NVML; older bindings have only the old name.
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        fn = fn or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(handle))

    # -- NVLink -------------------------------------------------------------------------------
    def _field_values(self, device: _Device, key: str, ids: list[Any]) -> list[int] | None:
        """Unsigned field values, or None when NVML refuses any of them (skipped from then)."""
        raw = self._read(
            device, key, lambda: self.nvml.nvmlDeviceGetFieldValues(device.handle, ids)
        )
        if raw is None:
            return None
        if any(v.nvmlReturn == _NOT_SUPPORTED for v in raw):
            self._mark_unsupported(device, key, "a field value is not supported")
            return None
        if any(v.nvmlReturn != 0 for v in raw):
            self._count_error(f"GPU {device.index} {key}: field value error")
            return None
        return [int(v.value.ullVal) for v in raw]

    def _active_nvlinks(self, device: _Device) -> list[int]:
        counts = self._field_values(device, "nvlink", [_FI_NVLINK_LINK_COUNT])
        return list(range(counts[0])) if counts else []

    def _nvlink_values(self, device: _Device, ts_ns: int) -> list[tuple[str, float]]:
        ids: list[Any] = []
        for link in device.nvlinks:
            ids += [(_FI_NVLINK_THROUGHPUT_TX_KIB, link), (_FI_NVLINK_THROUGHPUT_RX_KIB, link)]
        ids += [
            _FI_NVLINK_CRC_DATA_ERRORS_TOTAL,
            _FI_NVLINK_REPLAY_ERRORS_TOTAL,
            _FI_NVLINK_RECOVERY_ERRORS_TOTAL,
        ]
        raw = self._field_values(device, "nvlink", ids)
        if raw is None:
            return []
        tx_kib, rx_kib = sum(raw[0:-3:2]), sum(raw[1:-3:2])
        out = [(m.NVLINK_ERROR_COUNT, float(sum(raw[-3:])))]
        previous, device.nvlink_prev = device.nvlink_prev, (tx_kib, rx_kib, ts_ns)
        # The throughput fields are cumulative counters: a rate needs two readings.
        if previous is not None and ts_ns > previous[2]:
            seconds = (ts_ns - previous[2]) / 1e9
            out += [
                (m.NVLINK_TX_BYTES_PER_S, max(tx_kib - previous[0], 0) * 1024 / seconds),
                (m.NVLINK_RX_BYTES_PER_S, max(rx_kib - previous[1], 0) * 1024 / seconds),
            ]
        return out

    # -- processes ----------------------------------------------------------------------------
    def _process_samples(self, device: _Device, ts_ns: int) -> list[MetricSample]:
        nv, h = self.nvml, device.handle
        memory: dict[int, float] = {}
        running = self._read(
            device, "processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h)
        )
        for proc in running or []:
            used = getattr(proc, "usedGpuMemory", None)  # None when the driver hides it
            if used is not None:
                memory[int(proc.pid)] = float(used)
        util: dict[int, float] = {}
        for sample in (
            self._read(device, "process_utilization", lambda: self._utilization(device)) or []
        ):
            util[int(sample.pid)] = float(sample.smUtil)
            device.last_process_ts_us = max(device.last_process_ts_us, int(sample.timeStamp))
        out = []
        for pid in sorted(set(memory) | set(util)):
            ident = self._identities.get(pid)
            for name, values in ((m.PROCESS_GPU_MEM_BYTES, memory), (m.PROCESS_GPU_UTIL_PCT, util)):
                if pid in values:
                    out.append(
                        MetricSample(
                            job_id=ident.job_id,
                            host=self.host,
                            rank=ident.rank,
                            device=device.index,
                            ts_ns=ts_ns,
                            name=name,
                            value=values[pid],
                        )
                    )
        return out

    def _utilization(self, device: _Device) -> list[Any]:
        try:
            return list(
                self.nvml.nvmlDeviceGetProcessUtilization(device.handle, device.last_process_ts_us)
            )
        except Exception as exc:
            if _error_code(exc) == _NOT_FOUND:  # no new samples since the last call
                return []
            raise

    # -- ECC / XID events ---------------------------------------------------------------------
    def _register_events(self) -> None:
        nv = self.nvml
        wanted = _EVENT_SINGLE_BIT_ECC | _EVENT_DOUBLE_BIT_ECC | _EVENT_XID
        for device in self._devices:
            if self._event_set is None:
                self._event_set = self._read(device, "events", nv.nvmlEventSetCreate)
                if self._event_set is None:
                    return
            supported = self._read(
                device, "events", lambda d=device: nv.nvmlDeviceGetSupportedEventTypes(d.handle)
            )
            if supported is None or not supported & wanted:
                continue
            self._read(
                device,
                "events",
                lambda d=device, s=supported: nv.nvmlDeviceRegisterEvents(
                    d.handle, s & wanted, self._event_set
                ),
            )

    def _poll_events(self, ts_ns: int) -> list[MetricSample]:
        if self._event_set is None:
            return []
        nv = self.nvml
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        out = []
        for _ in range(_MAX_EVENTS_PER_INTERVAL):
            try:
                event = wait(self._event_set, 0)  # timeout 0 ms: never blocks
            except Exception as exc:
                if _error_code(exc) != _TIMEOUT:
                    self._count_error(f"event wait: {exc}")
                break
            self.stats.events += 1
            index = self._quiet(lambda e=event: nv.nvmlDeviceGetIndex(e.device))
            name = m.XID_EVENTS if event.eventType & _EVENT_XID else m.ECC_ERRORS
            if name == m.XID_EVENTS:
                log.warning("nvml: XID %s on GPU %s", event.eventData, index)
            out.append(
                MetricSample(
                    job_id=self.default_job_id,
                    host=self.host,
                    device=-1 if index is None else int(index),
                    ts_ns=ts_ns,
                    name=name,
                    value=1.0,
                )
            )
        return out

    # -- error handling -----------------------------------------------------------------------
    def _read(self, device: _Device, key: str, fn: Callable[[], Any]) -> Any:
        """One NVML call: None if the field is (now known to be) unsupported or failed."""
        if (device.index, key) in self.unsupported:
            return None
        self.stats.events += 1
        try:
            return fn()
        except AttributeError as exc:  # an older nvidia-ml-py without this function
            self._mark_unsupported(device, key, str(exc))
        except Exception as exc:
            if _error_code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                self._mark_unsupported(device, key, str(exc))
            else:
                self._count_error(f"GPU {device.index} {key}: {exc}")
        return None

    def _mark_unsupported(self, device: _Device, key: str, why: str) -> None:
        self.unsupported.add((device.index, key))
        log.info("nvml: GPU %d does not support %s (%s); not asking again", device.index, key, why)

    def _count_error(self, message: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = message
        log.debug("nvml: %s", message)

    @staticmethod
    def _quiet(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:
            return None
