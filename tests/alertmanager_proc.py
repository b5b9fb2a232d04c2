"""A real Prometheus Alertmanager for the tests, and the webhook receiver it notifies.

The Debian package ``prometheus-alertmanager`` (``infra/setup-test-host.sh`` installs it) runs
on loopback with clustering off and its own storage directory. Its one route groups alerts by
``alertname`` and ``job_id`` and sends them, with resolved ones, to a webhook served by
:class:`WebhookReceiver` in the test process. The group timings are short so that a test
sees a notification within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

START_TIMEOUT_S = 15.0
BINARIES = ("prometheus-alertmanager", "alertmanager")


def alertmanager_binary() -> str | None:
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    return None


def require_alertmanager() -> None:
    """Skip where the binary is missing, but never in CI, which installs it."""
    if alertmanager_binary() is None:
        reason = ("prometheus-alertmanager is not installed (infra/setup-test-host.sh "
                  "installs it)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ms(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"


class WebhookReceiver:
    """Collects the JSON bodies Alertmanager posts; tests wait on them without sleeping."""

    def __init__(self) -> None:
        self.notifications: list[dict[str, Any]] = []
        self._arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._arrived:
                    receiver.notifications.append(json.loads(body))
                    receiver._arrived.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for(self, predicate, timeout_s: float) -> list[dict[str, Any]]:
        """Wait until ``predicate(notifications)`` holds; the notifications so far either way."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while not predicate(self.notifications):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._arrived.wait(left)
            return list(self.notifications)


class Alertmanager:
    """``prometheus-alertmanager`` on 127.0.0.1 with a webhook receiver at ``webhook_url``."""

    def __init__(self, directory: Path, webhook_url: str, *, group_wait_s: float = 1.0,
                 group_interval_s: float = 1.0, resolve_timeout_s: float = 5.0,
                 port: int | None = None) -> None:
        binary = alertmanager_binary()
        if binary is None:
            raise RuntimeError("no Alertmanager binary: apt-get install prometheus-alertmanager")
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "alertmanager.yml"
        config.write_text(
            f"global:\n  resolve_timeout: {_ms(resolve_timeout_s)}\n"
            "route:\n  receiver: hook\n  group_by: [alertname, job_id]\n"
            f"  group_wait: {_ms(group_wait_s)}\n  group_interval: {_ms(group_interval_s)}\n"
            "  repeat_interval: 1h\n"
            "receivers:\n- name: hook\n  webhook_configs:\n"
            f"  - url: {webhook_url}\n    send_resolved: true\n"
        )
        self._log = (directory / "alertmanager.log").open("wb")
        self._process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--cluster.listen-address=", f"--storage.path={directory / 'data'}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.log_path = directory / "alertmanager.log"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Alertmanager exited: {self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"Alertmanager not ready in {START_TIMEOUT_S} s: "
                           f"{self.log_path.read_text()}")

    def alerts(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=5) as response:
            return json.loads(response.read())

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(10)
        self._log.close()
