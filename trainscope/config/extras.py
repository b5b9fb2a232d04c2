"""Which extra of the distribution installs each optional module, and what provides the few
that no extra installs.

Kept with the configuration, below every layer that reports a missing module: the commands
(:mod:`trainscope.cli.extras`) and the detector registry (a detector whose package is missing)
name the same install line from this one table.
"""

from __future__ import annotations

# Top-level module → the extras of pyproject.toml that install it (preferred first).
# tests/cli/test_missing_extras.py checks every pair against pyproject.toml.
MODULE_EXTRAS: dict[str, tuple[str, ...]] = {
    "starlette": ("ui",),
    "uvicorn": ("ui",),
    "jinja2": ("ui",),
    "plotly": ("ui",),
    "matplotlib": ("whatif",),
    "pandas": ("embedded", "stream", "whatif"),
    "pyarrow": ("embedded", "stream", "whatif"),
    "river": ("embedded", "stream"),
    "sklearn": ("embedded", "stream"),
    "chdb": ("embedded",),
    "clickhouse_connect": ("embedded", "stream", "ui"),
    "aiokafka": ("stream", "host"),
    "faust": ("stream",),
    "prometheus_client": ("stream", "host"),
    "pynvml": ("host",),
}

# Modules that no extra installs: what provides them instead.
OTHER_PACKAGES: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install torch"),
    "bcc": ("bcc (eBPF)", "install the OS package python3-bpfcc (apt-get install python3-bpfcc)"),
}
