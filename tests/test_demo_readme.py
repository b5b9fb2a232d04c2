"""The README's demo as a user sees it: the same diagnosis whatever the job's start time.

The demo runs in-process through the ``demo`` command (the README's arguments, read from the
README itself) on the in-memory bus without a store, so twenty 64-rank runs fit in a few minutes.
"""

from __future__ import annotations

import functools
import gc
import re
import shlex
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from trainscope.cli.demo import demo

README = Path(__file__).parents[1] / "README.md"
RUNS = 20
# Windows are aligned to multiples of the window length in Unix time, so the start time decides
# which steps share a window (15 or 16 windows, a step split across two). Steps of 7 s are
# coprime with the 15 s window, so twenty runs visit every phase.
START_STEP_S = 7
CULPRIT = ("13", "gpu-compute", "torch_op/backward")


def readme_demo() -> tuple[list[str], str]:
    """The arguments of the demo command shown in the README's tour, and its sample output."""
    block = re.search(r"```text\n\$ trainscope demo (.*?)\n(.*?)```", README.read_text(), re.S)
    assert block, "the README shows no `$ trainscope demo` sample"
    return shlex.split(block[1]), block[2]


def readme_start_s() -> int:
    args, _ = readme_demo()
    assert "--start-s" in args, "the README's demo must fix --start-s to be reproducible"
    return int(args[args.index("--start-s") + 1])


@functools.cache
def run_demo_cli(start_s: int) -> tuple[str, tuple[str, ...]]:
    """(stdout, warnings raised) of the README's demo started at ``start_s``, without a store."""
    args, _ = readme_demo()
    if "--start-s" in args:
        i = args.index("--start-s")
        del args[i : i + 2]
    # Garbage that earlier tests left (an unclosed pipe, a finished subprocess) warns when it is
    # collected; collect it now, so that only what the demo itself raises is caught below.
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(
            demo, [*args, "--start-s", str(start_s), "--no-store"], catch_exceptions=False
        )
    assert result.exit_code == 0, result.output
    return result.stdout, tuple(f"{w.category.__name__}: {w.message}" for w in caught)


def table_rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("│").split("│")]
            for line in output.splitlines() if line.startswith("│")]


def alerts(output: str) -> list[str]:
    """The 'category: rank N' of every ALERT line (one per suspect and cause that alerted); each
    line names the demo's job first, as the pipeline's lines do."""
    pattern = r"^ALERT \[[0-9.]+\] demo-job: ([a-z-]+: rank -?\d+)"
    return [m[1] for m in re.finditer(pattern, output, re.M)]


@pytest.mark.slow
@pytest.mark.parametrize("run", range(RUNS))
def test_readme_demo_gives_one_diagnosis_at_every_start_time(run: int) -> None:
    output, caught = run_demo_cli(readme_start_s() + START_STEP_S * run)
    assert caught == (), "library warnings reach the user"
    rows = table_rows(output)
    assert [tuple(r[1:4]) for r in rows] == [CULPRIT], output
    _, _, _, _, score, windows, victims = rows[0]
    assert float(score) >= 0.5 and int(victims) > 0, output
    # Each window counted once however many detectors reported the rank in it.
    total_windows = int(re.search(r"span events in (\d+) windows", output)[1])
    assert 0 < int(windows) <= total_windows, output
    assert alerts(output) == ["gpu-compute: rank 13"], output
    _, _, prime = output.partition("Prime suspect: ")  # the last lines, without a store
    assert "rank 13" in prime and "torch_op/backward" in prime, output


def _comparable(text: str) -> str:
    """Output without what legitimately differs between machines: the timing, the store line,
    and line wrapping (which follows the terminal's width)."""
    text = re.sub(r"^store: .*\Z", "", text, flags=re.M | re.S)
    text = " ".join(text.split())
    return re.sub(r"\d[\d.]* s \([\d,]+ events/s\)", "<timing>", text)


@pytest.mark.slow
def test_readme_sample_is_what_the_demo_prints() -> None:
    _, sample = readme_demo()
    output, _ = run_demo_cli(readme_start_s())
    assert _comparable(output) == _comparable(sample)


@pytest.mark.slow
def test_readme_mid_run_sample_flags_the_straggler_before_its_window_closes() -> None:
    """The README's second demo: a fault from step 60 is first flagged from step records
    (the early flag), rank 13 as a straggler, then explained at the window's close."""
    blocks = re.findall(r"```text\n\$ trainscope demo (.*?)\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2, "the README shows no mid-run demo sample"
    args, sample = shlex.split(blocks[1][0]), blocks[1][1]
    result = CliRunner().invoke(demo, [*args, "--no-store"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = alerts(result.stdout)
    assert lines[:2] == ["straggler: rank 13", "gpu-compute: rank 13"], lines
    # The flag's line is the README's, word for word (the window's lines are cut short there).
    first_alert = _comparable(result.stdout).split(" ALERT ")[0]
    assert first_alert == _comparable(sample).split(" ALERT ")[0], first_alert
