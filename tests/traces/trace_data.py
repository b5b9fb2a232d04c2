"""Where the recorded traces kept with the tests are (a module of its own: test modules import
it by name, and ``conftest`` is a name several test directories share)."""

from __future__ import annotations

from pathlib import Path

H100 = Path(__file__).resolve().parent.parent / "data" / "kineto-cuda-h100"
H100_TRACES = sorted(H100.glob("*.json.gz"))
