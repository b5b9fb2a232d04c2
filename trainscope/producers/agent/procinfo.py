"""What the agent learns about host processes from /proc: which ones are training processes
(they map the CUDA runtime, the CUDA driver or NCCL) and which job and rank each belongs to.

The job/rank come from the process's initial environment (``/proc/PID/environ``), which every
launcher we know of fills in: torchrun/torch.distributed (``RANK``, ``LOCAL_RANK``,
``TORCHELASTIC_RUN_ID``), Open MPI, PMI/MPICH and Slurm, plus our own ``TRAINSCOPE_JOB_ID``.
Reading another process's environ needs the same user or ``CAP_SYS_PTRACE``; when it is denied
the process is still traced, with rank -1.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# First match wins; TRAINSCOPE_JOB_ID lets a user name the job explicitly.
JOB_ID_VARS = ("TRAINSCOPE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")
RANK_VARS = (
    "TRAINSCOPE_RANK",
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "SLURM_PROCID",
)
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")

# Library families a training process maps; "cuda" (the driver) marks a GPU process even when
# the runtime is linked statically.
LIBRARY_PATTERNS: dict[str, re.Pattern[str]] = {
    "cudart": re.compile(r"/libcudart\.so[.\d]*$"),
    "cuda": re.compile(r"/libcuda\.so[.\d]*$"),
    "nccl": re.compile(r"/libnccl\.so[.\d]*$"),
}


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    job_id: str
    rank: int
    local_rank: int = -1


def read_environ(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    """The initial environment of ``pid``; empty when unreadable or the process is gone."""
    try:
        raw = (proc_root / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _first_int(env: dict[str, str], names: Iterable[str]) -> int:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return -1


def identity_from_environ(pid: int, env: dict[str, str], default_job_id: str) -> ProcessIdentity:
    job_id = next((env[n] for n in JOB_ID_VARS if env.get(n)), default_job_id)
    return ProcessIdentity(
        pid=pid,
        job_id=job_id,
        rank=_first_int(env, RANK_VARS),
        local_rank=_first_int(env, LOCAL_RANK_VARS),
    )


def start_time(pid: int, proc_root: Path = Path("/proc")) -> int:
    """Process start time in clock ticks since boot (field 22 of /proc/PID/stat); -1 if gone.

    Together with the PID it identifies a process across PID reuse.
    """
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return -1
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else -1


class IdentityCache:
    """PID → job/rank, read once per process (environ never changes) and keyed on start time."""

    def __init__(
        self, default_job_id: str, proc_root: Path = Path("/proc"), max_entries: int = 4096
    ) -> None:
        self.default_job_id = default_job_id
        self.proc_root = proc_root
        self.max_entries = max_entries
        self._cache: dict[int, tuple[int, ProcessIdentity]] = {}

    def get(self, pid: int) -> ProcessIdentity:
        started = start_time(pid, self.proc_root)
        hit = self._cache.get(pid)
        if hit is not None and (hit[0] == started or started == -1):
            return hit[1]
        ident = identity_from_environ(pid, read_environ(pid, self.proc_root), self.default_job_id)
        if len(self._cache) >= self.max_entries:
            # Bounded: forget the oldest half (dicts keep insertion order).
            for key in list(self._cache)[: self.max_entries // 2]:
                del self._cache[key]
        self._cache[pid] = (started, ident)
        return ident


def list_pids(proc_root: Path = Path("/proc")) -> Iterator[int]:
    try:
        names = os.listdir(proc_root)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def mapped_libraries(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    """Library family → path (as the process sees it) for the CUDA/NCCL libraries it maps."""
    found: dict[str, str] = {}
    try:
        with open(proc_root / str(pid) / "maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                if ".so" not in line:
                    continue
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                for family, pattern in LIBRARY_PATTERNS.items():
                    if family not in found and pattern.search(path):
                        found[family] = path
    except OSError:
        return {}
    return found


def host_path(pid: int, path: str, proc_root: Path = Path("/proc")) -> str:
    """A path the agent can open for a file the process maps, across mount namespaces.

    Inside the same mount namespace the plain path names the same file; for a process in a
    container the file is reached through ``/proc/PID/root``.
    """
    via_root = f"{proc_root}/{pid}/root{path}"
    try:
        plain, mapped = os.stat(path), os.stat(via_root)
    except OSError:
        return via_root if os.path.exists(via_root) else path
    if (plain.st_dev, plain.st_ino) == (mapped.st_dev, mapped.st_ino):
        return path
    return via_root
