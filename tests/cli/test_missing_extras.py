"""A missing optional package, really hidden from a subprocess: one line naming what to install.

Each run puts a meta-path finder that refuses the extra's modules in front of the import system,
then runs the ``trainscope`` command as a user would.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainscope.config.extras import MODULE_EXTRAS

ROOT = Path(__file__).parents[2]

HIDE = """
import importlib.abc, sys
HIDDEN = set(sys.argv[1].split(","))
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
sys.argv = ["trainscope", *sys.argv[2:]]
from trainscope.cli.main import main
main()
"""


def run_hidden(hidden: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE, hidden, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def op_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("optrace")
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", "demo", "--ranks", "8",
                           "--steps", "20", "--no-store", "--optrace", str(directory)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return directory


CASES = [
    ("uvicorn", ["ui", "--store", "{tmp}/store"], "'ui' extra", "trainscope[ui]"),
    ("starlette", ["ui", "--store", "{tmp}/store"], "'ui' extra", "trainscope[ui]"),
    ("matplotlib", ["whatif", "--trace", "{trace}/optrace.parquet", "--meta",
                    "{trace}/optrace.yaml", "--heatmap", "{tmp}/h.png", "--store", "{tmp}/s"],
     "'whatif' extra", "trainscope[whatif]"),
    ("chdb", ["demo", "--ranks", "8", "--steps", "10", "--store", "{tmp}/store"],
     "'embedded' extra", "trainscope[embedded]"),
    ("clickhouse_connect", ["sql", "SELECT 1", "--store", "{tmp}/store", "--create"],
     "'embedded' extra", "trainscope[embedded]"),
    ("aiokafka", ["pipeline", "--bus", "kafka://127.0.0.1:1", "--store", "{tmp}/store"],
     "'stream' extra", "trainscope[stream]"),
    ("faust", ["stream", "faust", "--bus", "kafka://127.0.0.1:1"], "'stream' extra",
     "trainscope[stream]"),
    ("pandas", ["whatif", "--trace", "{trace}/optrace.parquet", "--meta",
                "{trace}/optrace.yaml", "--store", "{tmp}/s"], "'whatif' extra",
     "trainscope[whatif]"),
]


@pytest.mark.parametrize(("hidden", "args", "names", "install"), CASES,
                         ids=[f"{c[0]}-{c[1][0]}" for c in CASES])
def test_missing_extra_is_one_line(hidden: str, args: list[str], names: str, install: str,
                                   op_trace: Path, tmp_path: Path) -> None:
    argv = [a.format(tmp=tmp_path, trace=op_trace) for a in args]
    done = run_hidden(hidden, *argv, cwd=tmp_path)
    assert done.returncode in (1, 2), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert names in lines[0] and f"pip install '{install}'" in lines[0], lines[0]
    assert lines[0].startswith(f"trainscope {args[0]}"), lines[0]


def test_every_mapped_extra_installs_the_module() -> None:
    """The table agrees with pyproject.toml: each extra it names lists a distribution of it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    dist = {"sklearn": "scikit-learn", "clickhouse_connect": "clickhouse-connect",
            "faust": "faust-streaming", "pynvml": "nvidia-ml-py", "prometheus_client":
            "prometheus_client"}

    def listed(extra: str) -> str:
        names = " ".join(extras[extra])
        for nested in ("stream", "embedded"):
            if f"trainscope[{nested}]" in names:
                names += " " + listed(nested)
        return names

    for module, named in MODULE_EXTRAS.items():
        for extra in named:
            assert dist.get(module, module) in listed(extra), (module, extra)


ATTACH_WITHOUT_TORCH = """
import importlib.abc, sys, threading
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
import trainscope
try:
    trainscope.attach(bus="kafka://127.0.0.1:1", job_id="j", rank=0, world_size=1)
except ImportError as exc:
    # Failed before anything started: no sender thread is left behind.
    print(type(exc).__name__, exc.name, threading.active_count(), exc, sep="|")
"""


def test_attach_without_torch_fails_fast_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", ATTACH_WITHOUT_TORCH], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("ImportError|torch|1|trainscope.attach() needs PyTorch in "
                                   "this environment: pip install torch"), done.stdout


def test_a_torch_import_error_in_a_command_is_one_line() -> None:
    from trainscope.cli.extras import missing_extra
    from trainscope.producers.torch.api import TORCH_MISSING

    missing = missing_extra("profile", ImportError(TORCH_MISSING, name="torch"))
    assert missing is not None
    assert missing.format_message() == "trainscope profile needs torch: pip install torch"


def test_profile_does_not_need_torch(tmp_path: Path) -> None:
    """``trainscope profile`` only sends a request over the bus; the rank it names profiles
    itself with its own torch. Without torch here it gets as far as the (unreachable) bus."""
    done = run_hidden("torch", "profile", "--job", "j", "--rank", "0", "--bus",
                      "kafka://127.0.0.1:1", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "torch" not in done.stderr, done.stderr
    assert "could not send the request" in done.stderr, done.stderr
