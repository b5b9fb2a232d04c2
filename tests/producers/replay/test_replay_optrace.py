"""``trainscope replay optrace``: a what-if op trace published on the bus, read back intact."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from click.testing import CliRunner

from trainscope.cli import replay as replay_cli
from trainscope.producers.replay.optrace import OPTRACE_TOPIC, decode_optrace, to_frame
from trainscope.transport.memory import MemoryBus


def _trace(tmp_path: Path, optype: str = "forward-compute") -> tuple[Path, Path]:
    rows = []
    for step in range(2):
        for dp in range(2):
            t = step * 1.0 + dp * 0.01
            rows += [
                dict(dp_rank=dp, stage=0, rank=dp, step=step, optype=optype, start_ts=t,
                     duration=0.2, seq_id=0, mc=0, gmc=0, mb_id=0),
                dict(dp_rank=dp, stage=0, rank=dp, step=step, optype="backward-compute",
                     start_ts=t + 0.2, duration=0.4, seq_id=1, mc=0, gmc=0, mb_id=0),
                dict(dp_rank=dp, stage=0, rank=dp, step=step, optype="grads-reduce-scatter",
                     start_ts=t + 0.6, duration=0.1, seq_id=2, mc=0, gmc=0, mb_id=-1),
                dict(dp_rank=dp, stage=0, rank=dp, step=step, optype="optimizer",
                     start_ts=t + 0.7, duration=0.05, seq_id=3, mc=0, gmc=0, mb_id=-1),
            ]
    trace = tmp_path / "job7.parquet"
    pd.DataFrame(rows).to_parquet(trace)
    meta = tmp_path / "job7.yaml"
    meta.write_text("dp_size: 2\npp_size: 1\ntp_size: 1\nworld_size: 2\n")
    return trace, meta


def test_an_op_trace_round_trips_through_the_bus(tmp_path, monkeypatch) -> None:
    trace, meta = _trace(tmp_path)
    bus = MemoryBus()
    monkeypatch.setattr(replay_cli, "open_bus", lambda url: bus)
    result = CliRunner().invoke(
        replay_cli.replay, ["optrace", str(trace), "--meta", str(meta), "--bus", "memory"]
    )
    assert result.exit_code == 0, result.output
    batches = [decode_optrace(m.value)
               for m in bus.consumer([OPTRACE_TOPIC], "c").poll(max_records=1000)]
    assert len(batches) == 2  # one per rank
    assert {b.job.job_id for b in batches} == {"job7"}
    assert (batches[0].job.dp_size, batches[0].job.pp_size) == (2, 1)
    got = to_frame(batches).sort_values(["rank", "step", "seq_id"]).reset_index(drop=True)
    original = pd.read_parquet(trace).sort_values(["rank", "step", "seq_id"])
    original = original.reset_index(drop=True)
    for column in original.columns:
        assert got[column].tolist() == original[column].tolist(), column


def test_a_bad_op_trace_gives_one_clear_line(tmp_path) -> None:
    trace, meta = _trace(tmp_path, optype="forward-compoot")
    result = CliRunner().invoke(
        replay_cli.replay, ["optrace", str(trace), "--meta", str(meta), "--bus", "memory"]
    )
    assert result.exit_code == 1
    line = result.output.strip()
    assert len(line.splitlines()) == 1 and "forward-compoot" in line and str(trace) in line
