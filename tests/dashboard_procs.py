"""``trainscope ui`` as a process of its own over a store, and plain GETs of it, for the
dashboard tests."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kafka_broker import free_port


@contextmanager
def serve(store: Path, log: Path, *args: str) -> Iterator[str]:
    """The dashboard of ``store`` (more options in ``args``) until the block ends: its URL,
    once it answers; its output in ``log``."""
    port = free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainscope.cli.main", "ui", "--store", str(store), "--port",
             str(port), *args], stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(url + "/api/jobs", timeout=2).read()
                break
            except urllib.error.HTTPError:
                break  # it answers; the crawl says what is wrong
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
