"""Importing the agent (and the mixture detector) must not import bcc, pynvml or sklearn."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("bcc", "pynvml", "sklearn")


def test_agent_modules_import_no_collector_library() -> None:
    code = (
        "import sys\n"
        "import trainscope.cli.agent, trainscope.producers.agent.daemon\n"
        "import trainscope.producers.agent.ebpf, trainscope.producers.agent.nvml\n"
        "import trainscope.detectors.mixture\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
