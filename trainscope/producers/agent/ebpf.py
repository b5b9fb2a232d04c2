"""The eBPF collector: CUDA runtime and NCCL calls (uprobes) and off-CPU time (sched_switch) of
training processes, aggregated in the kernel and read once per interval.

It needs bcc from the OS package ``python3-bpfcc`` (never the unrelated PyPI ``bcc``), root (or
CAP_SYS_ADMIN), kernel headers and a mounted tracefs — ``infra/ebpf-host-setup.sh`` prepares a
host. It uses uprobes and one tracepoint only, so kernels built without kprobes work.

Resolution: latencies are kept in log2 buckets in the kernel. Each bucket becomes one entry of
the summary's quantile sketch at the bucket's midpoint (1.5 × its lower bound), so quantiles of
these summaries are accurate to within a factor of about 1.5, not the sketch's usual 1%;
count, total, min, max and bytes are exact. ``m2_ns2`` is estimated from the bucket midpoints.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from trainscope.producers.agent import bpf_program, procinfo
from trainscope.producers.agent.base import (
    LOAD_FAILED,
    NO_BCC,
    NO_BPF_PERMISSION,
    NO_KERNEL_HEADERS,
    NO_TRACEFS,
    CollectorStats,
    CollectorUnavailable,
)
from trainscope.schemas import sketch
from trainscope.schemas.records import FunctionSummary

log = logging.getLogger(__name__)

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
SETUP_HINT = "run infra/ebpf-host-setup.sh as root"
# Kernel headers from another release produce harmless warnings; keep the agent's log readable.
_CFLAGS = [
    "-Wno-ignored-attributes",
    "-Wno-duplicate-decl-specifier",
    "-Wno-unknown-warning-option",
]


def effective_capabilities(proc_root: Path = Path("/proc")) -> int:
    """The CapEff bitmask of this process (0 when it cannot be read)."""
    try:
        for line in (proc_root / "self" / "status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def preflight(proc_root: Path = Path("/proc")) -> Any:
    """Check what bcc needs, in the order a person would fix it; return the ``bcc`` module.

    Raises :class:`CollectorUnavailable` naming the first missing piece.
    """
    try:
        import bcc  # the OS package python3-bpfcc
    except ImportError as exc:
        raise CollectorUnavailable(
            NO_BCC,
            f"bcc is not importable ({exc}): install the OS package python3-bpfcc (not the PyPI "
            f"package 'bcc') and {SETUP_HINT} so this Python can see it",
        ) from None
    caps = effective_capabilities(proc_root)
    has = lambda cap: bool(caps >> cap & 1)  # noqa: E731
    if not (has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON))):
        raise CollectorUnavailable(
            NO_BPF_PERMISSION,
            f"no BPF permission: running as uid {os.geteuid()} with effective capabilities "
            f"{caps:#x}; loading BPF programs and uprobes needs root (CAP_SYS_ADMIN, or "
            f"CAP_BPF + CAP_PERFMON)",
        )
    release = platform.release()
    build = Path(f"/lib/modules/{release}/build")
    if not build.exists() and not Path("/sys/kernel/kheaders.tar.xz").exists():
        raise CollectorUnavailable(
            NO_KERNEL_HEADERS,
            f"no kernel headers for kernel {release}: {build} is missing; {SETUP_HINT} "
            f"(installs a linux-headers package and links it there)",
        )
    if not any(
        Path(p).is_dir() for p in ("/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events")
    ):
        raise CollectorUnavailable(
            NO_TRACEFS, f"tracefs is not mounted (no /sys/kernel/tracing/events); {SETUP_HINT}"
        )
    return bcc


def log2_histogram_to_sketch(slots: dict[int, int]) -> tuple[list[int], list[int]]:
    """Map log2 slots (``[2**s, 2**(s+1))`` ns) to sketch keys at each slot's midpoint."""
    if not slots:
        return [], []
    ordered = sorted(slots)
    midpoints_ns = np.array([1.5 * 2.0**s for s in ordered])
    keys = sketch.bucket_keys(midpoints_ns).tolist()
    merged: dict[int, int] = {}
    for key, slot in zip(keys, ordered, strict=True):
        merged[key] = merged.get(key, 0) + slots[slot]
    return sorted(merged), [merged[k] for k in sorted(merged)]


def sketch_to_log2_slots(keys: list[int], counts: list[int]) -> dict[int, int]:
    """The log2 slots a sketch made by :func:`log2_histogram_to_sketch` came from."""
    values = np.asarray(sketch.bucket_value(np.asarray(keys, dtype=np.int64)), dtype=np.float64)
    slots = np.floor(np.log2(values / 1.5) + 0.5).astype(int).tolist()
    return dict(zip(slots, counts, strict=True))


class EbpfCollector:
    """Per-function summaries (layers ``cuda_api``, ``collective``, ``sched``) per process.

    ``pids`` restricts tracing to those processes (they are still required to map a CUDA or
    NCCL library); by default every such process on the host is traced, found by scanning
    ``/proc/*/maps`` every ``discovery_interval_s``. ``functions`` restricts the probed CUDA/NCCL
    functions: each probed call costs the traced process a few microseconds (two traps), which
    matters for ``cudaLaunchKernel`` at tens of thousands of launches per second.
    """

    name = "ebpf"

    def __init__(
        self,
        *,
        default_job_id: str = "unknown",
        pids: Iterable[int] | None = None,
        functions: Iterable[str] | None = None,
        discovery_interval_s: float = 5.0,
        grace_s: float = 0.002,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.default_job_id = default_job_id
        self.pids = None if pids is None else frozenset(pids)
        known = {p.name for p in bpf_program.PROBES}
        self.functions = known if functions is None else frozenset(functions)
        if unknown := sorted(set(self.functions) - known):
            raise ValueError(
                f"unknown function(s) to probe: {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        self.discovery_interval_s = discovery_interval_s
        self.grace_s = grace_s
        self.proc_root = proc_root
        self.stats = CollectorStats()
        self._bpf: Any = None
        self._generation = 0
        self._functions = bpf_program.function_table()
        self._identities = procinfo.IdentityCache(default_job_id, proc_root)
        self._tracked: set[int] = set()
        self._attached: set[tuple[int, int]] = set()  # (st_dev, st_ino) of probed libraries
        self._last_discovery = -float("inf")

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        bcc = preflight(self.proc_root)
        try:
            self._bpf = bcc.BPF(text=bpf_program.render().encode(), cflags=_CFLAGS)
        except Exception as exc:
            text = str(exc)
            if "Operation not permitted" in text or "Permission denied" in text:
                kind, text = NO_BPF_PERMISSION, f"no BPF permission: {text}"
            else:
                kind, text = LOAD_FAILED, f"BPF program failed to load: {text}"
            raise CollectorUnavailable(kind, text) from None
        self.discover()

    def collect(self, window_start_ns: int, window_end_ns: int) -> list[FunctionSummary]:
        if time.monotonic() - self._last_discovery >= self.discovery_interval_s:
            self.discover()
        previous = self._generation
        self._generation ^= 1
        self._bpf[b"generation"][ctypes.c_uint32(0)] = ctypes.c_uint32(self._generation)
        # Probes that read the old generation just before the flip finish within microseconds
        # (BPF programs do not sleep); wait them out so the drained maps are quiescent.
        time.sleep(self.grace_s)
        return self._drain(previous, window_start_ns, window_end_ns)

    def stop(self, window_start_ns: int, window_end_ns: int) -> list[FunctionSummary]:
        if self._bpf is None:
            return []
        bpf = self._bpf
        try:
            # Detach every probe first, so both generations are final when read.
            for ev_name in list(bpf.uprobe_fds):
                with contextlib.suppress(Exception):
                    bpf.detach_uprobe_event(ev_name)
            for tracepoint in list(bpf.tracepoint_fds):
                with contextlib.suppress(Exception):
                    bpf.detach_tracepoint(tracepoint)
            out = self._drain(self._generation ^ 1, window_start_ns, window_end_ns)
            out += self._drain(self._generation, window_start_ns, window_end_ns)
        finally:
            self._bpf = None
            bpf.cleanup()
        return out

    @property
    def tracked_pids(self) -> frozenset[int]:
        return frozenset(self._tracked)

    @property
    def probes_attached(self) -> int:
        return 0 if self._bpf is None else len(self._bpf.uprobe_fds)

    # -- discovery ----------------------------------------------------------------------------
    def discover(self) -> None:
        """Find training processes, attach probes to libraries not seen yet, track new PIDs."""
        self._last_discovery = time.monotonic()
        candidates = self.pids if self.pids is not None else procinfo.list_pids(self.proc_root)
        alive: set[int] = set()
        for pid in candidates:
            libraries = procinfo.mapped_libraries(pid, self.proc_root)
            if not libraries:
                continue
            alive.add(pid)
            for family, path in libraries.items():
                self._attach_library(pid, family, path)
            if pid not in self._tracked:
                self._identities.get(pid)  # read environ while the process is surely alive
                self._bpf[b"tracked"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
                self._tracked.add(pid)
        for pid in self._tracked - alive:
            with contextlib.suppress(KeyError):
                del self._bpf[b"tracked"][ctypes.c_uint32(pid)]
        self._tracked = alive
        self.stats.extra["processes"] = len(alive)
        self.stats.extra["probes"] = self.probes_attached

    def _attach_library(self, pid: int, family: str, path: str) -> None:
        probes = [
            (i, p)
            for i, p in enumerate(bpf_program.PROBES)
            if p.library == family and p.name in self.functions
        ]
        if not probes:
            return
        usable = procinfo.host_path(pid, path, self.proc_root)
        try:
            st = os.stat(usable)
        except OSError:
            return
        if (st.st_dev, st.st_ino) in self._attached:
            return
        self._attached.add((st.st_dev, st.st_ino))
        pattern = "^(" + "|".join(re.escape(p.name) for _, p in probes) + ")$"
        bpf_cls = type(self._bpf)
        try:
            present = {
                name.decode()
                for name, _ in bpf_cls.get_user_functions_and_addresses(
                    usable.encode(), pattern.encode()
                )
            }
        except Exception as exc:
            self._error(f"cannot read symbols of {usable}: {exc}")
            return
        for index, probe in probes:
            if probe.name not in present:
                continue
            try:
                self._bpf.attach_uprobe(
                    name=usable.encode(), sym=probe.name.encode(), fn_name=f"entry_{index}".encode()
                )
                self._bpf.attach_uretprobe(
                    name=usable.encode(),
                    sym=probe.name.encode(),
                    fn_name=f"return_{index}".encode(),
                )
            except Exception as exc:
                self._error(f"cannot attach to {probe.name} in {usable}: {exc}")
        log.info("ebpf: probing %s (%s) for pid %d", usable, family, pid)

    def _error(self, message: str) -> None:
        self.stats.errors += 1
        self.stats.last_error = message
        log.warning("ebpf: %s", message)

    # -- reading the maps ---------------------------------------------------------------------
    def _drain_table(self, table: Any) -> list[tuple[Any, Any]]:
        try:
            return list(table.items_lookup_and_delete_batch())
        except Exception:
            # Kernels before 5.6 have no batch operations: read, then delete one by one.
            items = list(table.items())
            for key, _ in items:
                with contextlib.suppress(KeyError):
                    del table[key]
            return items

    def _drain(
        self, generation: int, window_start_ns: int, window_end_ns: int
    ) -> list[FunctionSummary]:
        aggregates = self._drain_table(self._bpf[f"agg_{generation}".encode()])
        histograms: dict[tuple[int, int], dict[int, int]] = {}
        for key, value in self._drain_table(self._bpf[f"hist_{generation}".encode()]):
            # Batch reads give plain ints, per-key reads ctypes values.
            count = int(getattr(value, "value", value))
            histograms.setdefault((key.tgid, key.fn), {})[key.slot] = count
        dropped = int(self._bpf[b"dropped"][ctypes.c_uint32(0)].value)
        self.stats.dropped = dropped
        out: list[FunctionSummary] = []
        for key, value in aggregates:
            if value.count == 0 or key.fn >= len(self._functions):
                continue
            out.append(
                self._summary(
                    key.tgid,
                    key.fn,
                    value,
                    histograms.get((key.tgid, key.fn), {}),
                    window_start_ns,
                    window_end_ns,
                )
            )
        self.stats.events += sum(s.count for s in out)
        self.stats.samples += len(out)
        return out

    def _summary(
        self,
        tgid: int,
        fn: int,
        value: Any,
        slots: dict[int, int],
        window_start_ns: int,
        window_end_ns: int,
    ) -> FunctionSummary:
        layer, name = self._functions[fn]
        ident = self._identities.get(tgid)
        count, total_ns = int(value.count), int(value.total_ns)
        mean_ns = total_ns / count
        m2_ns2 = float(sum(c * (1.5 * 2.0**s - mean_ns) ** 2 for s, c in slots.items()))
        keys, counts = log2_histogram_to_sketch(slots)
        return FunctionSummary(
            job_id=ident.job_id,
            rank=ident.rank,
            layer=layer,
            name=name,
            window_start_ns=window_start_ns,
            window_end_ns=max(window_end_ns, window_start_ns + 1),
            count=count,
            total_ns=total_ns,
            m2_ns2=m2_ns2,
            min_ns=int(value.min_ns),
            max_ns=int(value.max_ns),
            bytes_total=int(value.bytes),
            sketch_keys=keys,
            sketch_counts=counts,
        )
