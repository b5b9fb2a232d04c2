"""Small things a new user hit: each a one-line error that says what is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainscope.schemas.optrace import TraceError, read_meta
from trainscope.traces.reader import KinetoError, read_trace


def trainscope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                          capture_output=True, text=True, timeout=120)


def test_pipeline_refuses_the_memory_bus() -> None:
    done = trainscope("pipeline", "--bus", "memory")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing could ever arrive" in lines[0], done.stderr


@pytest.mark.parametrize(("content", "says"), [
    (b"PAR1\x15\x04\x15\x10", "not JSON: it is a Parquet file"),
    (b"dp_size: 2\npp_size: 1\n", "not JSON (it looks like YAML)"),
])
def test_replay_kineto_on_a_non_json_file_says_so(tmp_path: Path, content: bytes,
                                                  says: str) -> None:
    path = tmp_path / "trace.bin"
    path.write_bytes(content * 100)
    with pytest.raises(KinetoError) as caught:
        read_trace(path, rank=0)
    assert says in str(caught.value) and "truncated" not in str(caught.value)


def test_broken_whatif_meta_yaml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "meta.yaml"
    path.write_text("dp_size: [2\n")
    with pytest.raises(TraceError) as caught:
        read_meta(path)
    text = str(caught.value)
    assert "\n" not in text and "not valid YAML (line 2, column 1" in text, text
