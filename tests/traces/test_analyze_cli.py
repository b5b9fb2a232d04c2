"""``trainscope analyze``: the report, --json, --flamegraph, the peer and run diffs, and the
peer diff on call paths read back from the store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner
from trace_data import H100_TRACES
from trace_jobs import assert_block_time

from trainscope.cli.traces import analyze


def _known(gloo_traces: Path) -> dict:
    return json.loads((gloo_traces / "extra_ns.txt").read_text())


def test_report_on_the_h100_trace_lists_suggestions_by_time_at_stake() -> None:
    result = CliRunner().invoke(analyze, [str(H100_TRACES[0]), "--rank", "0"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("rank 0: GPU time") and "gemm" in lines[0]
    stakes = [float(line.split(", ")[1].split(" ms")[0]) for line in lines
              if line[:3].strip().rstrip(".").isdigit()]
    assert len(stakes) >= 2 and stakes == sorted(stakes, reverse=True)
    assert "try: " in result.output


def test_json_and_flamegraph(gloo_traces: Path, tmp_path) -> None:
    out = tmp_path / "cct.speedscope.json"
    result = CliRunner().invoke(analyze, [str(gloo_traces), "--json", "--flamegraph", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    known = _known(gloo_traces)
    diff = report["peer_diff"]
    assert diff["rank"] == known["rank"] and diff["peers"] == 1  # found without --suspect
    (block,) = [d for d in diff["chain"] if d["name"] == "extra_work"]
    assert_block_time(block["delta_total_ns"], known)
    # speedscope's file format, checked structurally (its viewer cannot run here).
    doc = json.loads(out.read_text())
    assert doc["$schema"] == "https://www.speedscope.app/file-format-schema.json"
    frames = doc["shared"]["frames"]
    assert {p["name"] for p in doc["profiles"]} == {"rank 0 host", "rank 1 host"}
    for profile in doc["profiles"]:
        assert profile["type"] == "sampled" and profile["unit"] == "nanoseconds"
        assert len(profile["samples"]) == len(profile["weights"])
        assert profile["endValue"] == sum(profile["weights"])
        assert all(0 <= f < len(frames) for stack in profile["samples"] for f in stack)
    assert any(frames[s[-1]]["name"] == "<built-in function sleep>"
               for p in doc["profiles"] if p["name"] == "rank 1 host" for s in p["samples"])


def test_run_diff_against_a_baseline(gloo_traces: Path) -> None:
    files = sorted(p for p in gloo_traces.iterdir() if ".pt.trace." in p.name)
    known = _known(gloo_traces)
    ranks = {json.loads(CliRunner().invoke(analyze, [str(f), "--json"]).output)["ranks"]
             .popitem()[0]: f for f in files}
    now, before = ranks[str(known["rank"])], ranks[str(1 - known["rank"])]
    result = CliRunner().invoke(analyze, [str(now), "--baseline", str(before), "--json"])
    assert result.exit_code == 0, result.output
    chain = json.loads(result.output)["run_diff"]["chain"]
    (block,) = [d for d in chain if d["name"] == "extra_work"]
    assert_block_time(block["delta_total_ns"], known)


def test_peer_diff_from_the_store(gloo_traces: Path, tmp_path) -> None:
    store = tmp_path / "store"
    run = [sys.executable, "-m", "trainscope.cli.main"]
    done = subprocess.run([*run, "replay", "kineto", str(gloo_traces), "--job", "J",
                           "--store", str(store)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr
    known = _known(gloo_traces)
    done = subprocess.run([*run, "analyze", "--job", "J", "--rank", str(known["rank"]),
                           "--store", str(store), "--json"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    chain = json.loads(done.stdout)["peer_diff"]["chain"]
    (block,) = [d for d in chain if d["name"] == "extra_work"]
    assert_block_time(block["delta_total_ns"], known)
    done = subprocess.run([*run, "analyze", "--job", "nope", "--rank", "0", "--store",
                           str(store)], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 1 and "no call paths of job 'nope' rank 0" in done.stderr


def test_usage_errors() -> None:
    assert CliRunner().invoke(analyze, []).exit_code == 2
    result = CliRunner().invoke(analyze, [str(H100_TRACES[0])])
    assert result.exit_code == 1 and "cannot tell the rank" in result.output


def test_a_trace_without_gpu_activity_says_where_the_host_time_went(gloo_traces: Path) -> None:
    known = _known(gloo_traces)
    files = sorted(p for p in gloo_traces.iterdir() if ".pt.trace." in p.name)
    reports = {f: json.loads(CliRunner().invoke(analyze, [str(f), "--json"]).output)
               for f in files}
    (extra,) = [f for f, r in reports.items() if str(known["rank"]) in r["ranks"]]
    host = reports[extra]["host_time_without_gpu"][str(known["rank"])]
    assert host["steps"] == 3  # the profiler's active steps
    top = host["most_self_time_ns"]
    # The rank's extra block sleeps: the sleep is where most of its host time went.
    assert "sleep" in top[0]["name"], top
    assert 0.9 * known["ns"] <= top[0]["self_ns"] <= host["total_ns"], (top[0], known)
    assert [f["self_ns"] for f in top] == sorted((f["self_ns"] for f in top), reverse=True)
    result = CliRunner().invoke(analyze, [str(extra)])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.startswith(f"rank {known['rank']}: no GPU activity; host time "), first
    assert "over 3 steps, most self time in: <built-in function sleep> " in first, first
