"""The NVML sampler against an NVML stand-in (no GPU here), passed in as the ``nvml`` parameter.

The stand-in mimics the parts of ``pynvml`` the sampler uses: error objects carry NVML's numeric
codes in ``.value``, units are NVML's (mW, KB/s, KiB), and it counts every call so the tests
can see what the sampler asked for. PID-to-rank mapping uses real child processes.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest

from trainscope.producers.agent.base import NO_GPU, NO_NVML_LIBRARY, CollectorUnavailable
from trainscope.producers.agent.nvml import NvmlSampler
from trainscope.producers.agent.throttle import decode_throttle_reasons
from trainscope.schemas import metrics as m
from trainscope.schemas.records import MetricSample


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


NOT_SUPPORTED, NOT_FOUND, TIMEOUT, LIBRARY_NOT_FOUND, GPU_IS_LOST = 3, 6, 10, 12, 15


class NvmlStandIn:
    """A stand-in for the ``pynvml`` module: devices are dicts of NVML-unit readings."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_TEMPERATURE_GPU = 0
    NVML_PCIE_UTIL_TX_BYTES, NVML_PCIE_UTIL_RX_BYTES = 0, 1
    NVMLError = NVMLError

    def __init__(self, devices: list[dict[str, Any]], init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.calls: Counter[str] = Counter()
        self.unsupported: set[tuple[int, str]] = set()  # (device, function name)
        self.fail_once: set[tuple[int, str]] = set()
        self.events: list[SimpleNamespace] = []
        self.wait_timeouts_ms: list[int] = []

    def _dev(self, fn: str, handle: int) -> dict[str, Any]:
        self.calls[fn] += 1
        if (handle, fn) in self.unsupported:
            raise NVMLError(NOT_SUPPORTED)
        if (handle, fn) in self.fail_once:
            self.fail_once.discard((handle, fn))
            raise NVMLError(GPU_IS_LOST)
        return self.devices[handle]

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        d = self._dev("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=d["sm_util"], memory=d["mem_util"])

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        d = self._dev("nvmlDeviceGetClockInfo", h)
        return d["sm_mhz"] if clock == self.NVML_CLOCK_SM else d["mem_mhz"]

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        return self._dev("nvmlDeviceGetMaxClockInfo", h)["sm_max_mhz"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._dev("nvmlDeviceGetCurrentClocksEventReasons", h)["reasons"]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._dev("nvmlDeviceGetPowerUsage", h)["power_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", h)["limit_mw"]

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._dev("nvmlDeviceGetTemperature", h)["temp_c"]

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        d = self._dev("nvmlDeviceGetPcieThroughput", h)
        return d["pcie_tx_kbs"] if counter == self.NVML_PCIE_UTIL_TX_BYTES else d["pcie_rx_kbs"]

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._dev("nvmlDeviceGetPcieReplayCounter", h)["replays"]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        d = self._dev("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(used=d["mem_used"], total=d["mem_total"], free=0)

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[Any]) -> list[SimpleNamespace]:
        d = self._dev("nvmlDeviceGetFieldValues", h)
        out = []
        for item in ids:
            field_id, link = item if isinstance(item, tuple) else (item, None)
            value = {91: d["links"], 45: 1, 52: 2, 59: 0}.get(field_id)
            if field_id == 138:
                value = d["nvlink_tx_kib"][link]
            elif field_id == 139:
                value = d["nvlink_rx_kib"][link]
            out.append(SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=value)))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        d = self._dev("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in d["procs"].items()]

    def nvmlDeviceGetProcessUtilization(self, h: int, since_us: int) -> list[SimpleNamespace]:
        d = self._dev("nvmlDeviceGetProcessUtilization", h)
        d.setdefault("since", []).append(since_us)
        fresh = [s for s in d["proc_util"] if s[1] > since_us]
        if not fresh:
            raise NVMLError(NOT_FOUND)
        return [SimpleNamespace(pid=p, timeStamp=t, smUtil=u, memUtil=0) for p, t, u in fresh]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetSupportedEventTypes(self, h: int) -> int:
        return 0x1 | 0x2 | 0x8

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        self.calls["nvmlDeviceRegisterEvents"] += 1

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        self.wait_timeouts_ms.append(timeout_ms)
        if not self.events:
            raise NVMLError(TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set: str) -> None:
        pass


def device(**overrides: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "sm_util": 87,
        "mem_util": 40,
        "sm_mhz": 1980,
        "mem_mhz": 2619,
        "sm_max_mhz": 1980,
        "reasons": 0,
        "power_mw": 612_345,
        "limit_mw": 700_000,
        "temp_c": 61,
        "pcie_tx_kbs": 2048,
        "pcie_rx_kbs": 4096,
        "replays": 0,
        "mem_used": 70 << 30,
        "mem_total": 141 << 30,
        "links": 2,
        "nvlink_tx_kib": [0, 0],
        "nvlink_rx_kib": [0, 0],
        "procs": {},
        "proc_util": [],
    }
    d.update(overrides)
    return d


def values(samples: list[MetricSample], dev: int, rank: int | None = None) -> dict[str, float]:
    return {
        s.name: s.value for s in samples if s.device == dev and (rank is None or s.rank == rank)
    }


@contextmanager
def processes(*envs: dict[str, str]) -> Iterator[list[int]]:
    """Real processes with the given environments, alive until the block ends.

    Each has exec'd before its pid is handed out: until then ``/proc/PID/environ`` is the
    forked parent's environment, and the sampler reads it once per process.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import sys; print(flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )
        for env in envs
    ]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline() == b"\n"
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def started(nvml: NvmlStandIn, **kwargs: Any) -> NvmlSampler:
    sampler = NvmlSampler(nvml, host="h1", **kwargs)
    sampler.start()
    return sampler


def test_device_fields_in_our_units() -> None:
    nvml = NvmlStandIn([device(), device(sm_mhz=1410, power_mw=300_000)])
    samples = started(nvml).collect(0, 1)
    d0, d1 = values(samples, 0), values(samples, 1)
    assert d0[m.SM_UTIL_PCT] == 87 and d0[m.MEM_UTIL_PCT] == 40
    assert d0[m.SM_CLOCK_MHZ] == 1980 and d1[m.SM_CLOCK_MHZ] == 1410
    assert d0[m.SM_CLOCK_MAX_MHZ] == 1980 and d0[m.MEM_CLOCK_MHZ] == 2619
    assert d0[m.POWER_W] == pytest.approx(612.345) and d1[m.POWER_W] == pytest.approx(300.0)
    assert d0[m.POWER_LIMIT_W] == pytest.approx(700.0)
    assert d0[m.TEMPERATURE_C] == 61
    assert d0[m.PCIE_TX_BYTES_PER_S] == 2048 * 1024 and d0[m.PCIE_RX_BYTES_PER_S] == 4096 * 1024
    assert d0[m.MEM_USED_BYTES] == 70 << 30 and d0[m.MEM_TOTAL_BYTES] == 141 << 30
    assert d0[m.THROTTLE_REASONS] == 0 and d0[m.PCIE_REPLAY_COUNT] == 0
    assert d0[m.NVLINK_ERROR_COUNT] == 3  # crc 1 + replay 2 + recovery 0
    assert all(s.host == "h1" and s.rank == -1 and s.job_id == "unknown" for s in samples)


def test_throttle_reasons_are_decoded_to_names() -> None:
    assert decode_throttle_reasons(0) == []
    assert decode_throttle_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_throttle_reasons(0x1 | 0x8 | 0x80) == [
        "gpu_idle",
        "hw_slowdown",
        "hw_power_brake_slowdown",
    ]
    assert decode_throttle_reasons(0x1000 | 0x20) == ["sw_thermal_slowdown", "unknown_0x1000"]
    nvml = NvmlStandIn([device(reasons=0x4 | 0x40, sm_mhz=1200)])
    d0 = values(started(nvml).collect(0, 1), 0)
    assert decode_throttle_reasons(int(d0[m.THROTTLE_REASONS])) == [
        "sw_power_cap",
        "hw_thermal_slowdown",
    ]


def test_reason_bits_and_throttling_mask_match_nvml() -> None:
    import pynvml  # nvidia-ml-py: a dependency of the host extra, installed for tests
    throttling = {"SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown",
                  "HwPowerBrakeSlowdown"}
    not_throttling = {"GpuIdle", "ApplicationsClocksSetting", "SyncBoost",
                      "DisplayClockSetting"}
    for reason in throttling | not_throttling:
        bit = getattr(pynvml, f"nvmlClocksEventReason{reason}", None)
        if bit is None:  # bindings older than the rename
            bit = getattr(pynvml, f"nvmlClocksThrottleReason{reason}")
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in reason).lstrip("_")
        assert m.THROTTLE_REASON_NAMES[bit].replace("_", "") == snake.replace("_", ""), reason
        assert bool(bit & m.THROTTLING_REASONS_MASK) == (reason in throttling), reason
    assert set(m.THROTTLE_REASON_NAMES) == {
        getattr(pynvml, f"nvmlClocksEventReason{r}", None)
        or getattr(pynvml, f"nvmlClocksThrottleReason{r}")
        for r in throttling | not_throttling
    }


def test_processes_mapped_to_pid_job_and_rank() -> None:
    envs = [
        {"RANK": "5", "LOCAL_RANK": "1", "TRAINSCOPE_JOB_ID": "llm-7"},
        {"OMPI_COMM_WORLD_RANK": "6", "SLURM_JOB_ID": "991"},
        {"RANK": "7", "TRAINSCOPE_JOB_ID": "llm-7"},
    ]
    with processes(*envs) as (a, b, c):
        nvml = NvmlStandIn(
            [
                device(procs={a: 30 << 30}, proc_util=[(a, 100, 93)]),
                device(procs={b: 1 << 30, c: 2 << 30}, proc_util=[(b, 100, 10), (c, 105, 20)]),
            ]
        )
        samples = started(nvml, default_job_id="fallback").collect(0, 1)
    per_process = {
        (s.device, s.job_id, s.rank, s.name): s.value
        for s in samples
        if s.name in (m.PROCESS_GPU_MEM_BYTES, m.PROCESS_GPU_UTIL_PCT)
    }
    assert per_process == {
        (0, "llm-7", 5, m.PROCESS_GPU_MEM_BYTES): 30 << 30,
        (0, "llm-7", 5, m.PROCESS_GPU_UTIL_PCT): 93,
        (1, "991", 6, m.PROCESS_GPU_MEM_BYTES): 1 << 30,
        (1, "991", 6, m.PROCESS_GPU_UTIL_PCT): 10,
        (1, "llm-7", 7, m.PROCESS_GPU_MEM_BYTES): 2 << 30,
        (1, "llm-7", 7, m.PROCESS_GPU_UTIL_PCT): 20,
    }
    # Device 0 has one training process: its metrics belong to that rank. Device 1 is shared.
    sm0 = next(s for s in samples if s.device == 0 and s.name == m.SM_CLOCK_MHZ)
    sm1 = next(s for s in samples if s.device == 1 and s.name == m.SM_CLOCK_MHZ)
    assert (sm0.job_id, sm0.rank) == ("llm-7", 5)
    assert (sm1.job_id, sm1.rank) == ("fallback", -1)


def test_process_utilisation_asks_only_for_new_samples() -> None:
    nvml = NvmlStandIn([device(proc_util=[(4242, 1_000, 50)])])
    sampler = started(nvml)
    first = sampler.collect(0, 1)
    second = sampler.collect(1, 2)  # no sample newer than 1000 µs: NVML says NOT_FOUND
    assert nvml.devices[0]["since"] == [0, 1_000]
    assert [s.value for s in first if s.name == m.PROCESS_GPU_UTIL_PCT] == [50]
    assert [s for s in second if s.name == m.PROCESS_GPU_UTIL_PCT] == []
    assert sampler.stats.errors == 0


def test_unsupported_fields_are_skipped_once_and_errors_retried() -> None:
    nvml = NvmlStandIn([device(), device()])
    nvml.unsupported |= {(0, "nvmlDeviceGetPowerUsage"), (1, "nvmlDeviceGetFieldValues")}
    nvml.fail_once.add((1, "nvmlDeviceGetTemperature"))
    sampler = started(nvml)
    rounds = [sampler.collect(i, i + 1) for i in range(5)]
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 1 + 5  # device 0 once, device 1 every round
    assert nvml.calls["nvmlDeviceGetFieldValues"] == 1 + 1 + 5  # link count ×2, then dev 0 only
    assert {(0, "power"), (1, "nvlink")} <= sampler.unsupported
    assert all(m.POWER_W not in values(r, 0) and m.POWER_W in values(r, 1) for r in rounds)
    assert all(m.NVLINK_ERROR_COUNT not in values(r, 1) for r in rounds)
    # A transient failure is counted and retried, not marked unsupported.
    assert m.TEMPERATURE_C not in values(rounds[0], 1)
    assert all(m.TEMPERATURE_C in values(r, 1) for r in rounds[1:])
    assert (1, "temperature") not in sampler.unsupported
    assert sampler.stats.errors == 1 and "temperature" in sampler.stats.last_error


def test_nvlink_rates_from_cumulative_counters() -> None:
    clock = iter([10**9, 3 * 10**9])
    nvml = NvmlStandIn([device(nvlink_tx_kib=[100, 200], nvlink_rx_kib=[0, 50])])
    sampler = started(nvml, clock_ns=lambda: next(clock))
    first = values(sampler.collect(0, 1), 0)
    assert m.NVLINK_TX_BYTES_PER_S not in first  # a rate needs two readings
    nvml.devices[0].update(nvlink_tx_kib=[100 + 1000, 200 + 3000], nvlink_rx_kib=[2000, 50])
    second = values(sampler.collect(1, 2), 0)
    assert second[m.NVLINK_TX_BYTES_PER_S] == pytest.approx(4000 * 1024 / 2)
    assert second[m.NVLINK_RX_BYTES_PER_S] == pytest.approx(2000 * 1024 / 2)


def test_xid_and_ecc_events_are_polled_without_blocking() -> None:
    nvml = NvmlStandIn([device(), device()])
    sampler = started(nvml)
    assert nvml.calls["nvmlDeviceRegisterEvents"] == 2
    nvml.events += [
        SimpleNamespace(device=1, eventType=0x8, eventData=79),
        SimpleNamespace(device=0, eventType=0x2, eventData=0),
    ]
    samples = sampler.collect(0, 1)
    events = sorted((s.name, s.device) for s in samples if s.name in (m.XID_EVENTS, m.ECC_ERRORS))
    assert events == [(m.ECC_ERRORS, 0), (m.XID_EVENTS, 1)]
    assert set(nvml.wait_timeouts_ms) == {0}
    assert sampler.collect(1, 2) and nvml.events == []


def test_missing_library_and_missing_gpu_are_told_apart() -> None:
    with pytest.raises(CollectorUnavailable) as no_lib:
        NvmlSampler(NvmlStandIn([], init_error=LIBRARY_NOT_FOUND)).start()
    assert no_lib.value.kind == NO_NVML_LIBRARY and "libnvidia-ml" in no_lib.value.reason
    with pytest.raises(CollectorUnavailable) as no_gpu:
        NvmlSampler(NvmlStandIn([])).start()
    assert no_gpu.value.kind == NO_GPU and "0 devices" in no_gpu.value.reason


def test_real_nvml_on_this_host() -> None:
    """With the real pynvml: either this host has a GPU and it samples, or it says why not."""
    sampler = NvmlSampler()
    try:
        sampler.start()
    except CollectorUnavailable as exc:
        assert exc.kind in (NO_NVML_LIBRARY, NO_GPU)
        assert exc.reason
        return
    try:
        samples = sampler.collect(0, 1)
        assert any(s.name == m.SM_CLOCK_MHZ and s.value > 0 for s in samples)
    finally:
        sampler.stop(0, 1)
