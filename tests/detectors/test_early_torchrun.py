"""The early flag on real processes: a straggler, and a stalled rank, named within seconds of
the onset, while the job runs and long before its window closes.

A 4-rank gloo DDP job on CPU under ``torchrun`` with ``trainscope.attach()``; ``trainscope
pipeline`` is its own process over the real broker, with 60-s windows. Rank 2 trains like its
peers for a few seconds, then

- sleeps 50 ms per step in the loop body, outside every hooked function: its peers wait for it
  in DDP's all-reduce (timed by the producer's comm hook, and summed into each step record's
  ``collective_ns``). The pipeline must print an ``ALERT`` naming rank 2 a ``straggler``.
- or stops for 25 s in the loop body (a stall): no step ends anywhere, its peers wait in the
  all-reduce, and the producers report the open step. The pipeline must print an ``ALERT``
  naming rank 2 as a ``hang`` while the stall lasts.

Either within 10 s of the onset, stored, and no other rank flagged. The straggler's flag starts
the closed loop at once: rank 2 profiled against a peer, the call path naming the sleep.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_procs import PipelineProcess, dump_tables, query_store

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORLD = 4
SLOW_RANK = 2
SLEEP_S = 0.05
ONSET_S = 5.0  # of steady training before rank 2 starts sleeping
WINDOW_S = 60.0
MAX_TRAIN_S = 60.0
MAX_FLAG_DELAY_S = 10.0
STALL_S = 25.0

SCRIPT = r'''
import json, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

import trainscope

JOB, SLOW_RANK, SLEEP_S, ONSET_S, MAX_S, STALL_S = (
    sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]),
    float(sys.argv[7]))
STOP = Path(sys.argv[6])

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
handle = trainscope.attach(job_id=JOB)  # bus and window from TRAINSCOPE_BUS / _WINDOW_S
assert handle is not None
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
data = torch.utils.data.TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
loader = torch.utils.data.DataLoader(data, batch_size=16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
stop = torch.zeros(1)
started = time.monotonic()
onset_ns = 0
steps = 0
while not stop.item():
    for x, y in loader:
        steps += 1
        with trainscope.step(samples=len(x)):
            if rank == SLOW_RANK and time.monotonic() - started > ONSET_S:
                if not onset_ns:
                    onset_ns = time.time_ns()
                    time.sleep(STALL_S)  # the injected stall, once
                time.sleep(SLEEP_S)  # the injected fault: loop-body code no hook times
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if steps % 10 == 0:  # rank 0 decides, every rank stops at the same step
            stop.fill_(float(rank == 0 and (STOP.exists() or time.monotonic() - started > MAX_S)))
            dist.broadcast(stop, src=0)
            if stop.item():
                break
handle.detach()
stats = handle.stats()
sys.stdout.write(json.dumps({"rank": rank, "steps": steps, "onset_ns": onset_ns,
                             "errors": stats["errors"]}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
'''


@pytest.mark.parametrize(("fault", "sleep_s", "stall_s"), [
    ("straggler", SLEEP_S, 0.0),
    ("hang", 0.0, STALL_S),
])
def test_a_straggler_or_a_stall_is_flagged_while_the_job_runs(
        fresh_kafka_broker, tmp_path: Path, fault: str, sleep_s: float, stall_s: float) -> None:
    job_id = f"early-{fault}-{os.getpid()}"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    store = tmp_path / "store"
    stop = tmp_path / "stop"
    pipeline = PipelineProcess(
        fresh_kafka_broker.url, store, f"pipeline-{job_id}",
        "--window-s", str(WINDOW_S), "--lateness-s", "2", "--commit-interval-s", "1",
        "--close-idle-s", "3", "--source-idle-s", "1", "--drain-on-stop",
        logs=tmp_path / "pipeline",
    )
    env = {**os.environ, "TRAINSCOPE_BUS": fresh_kafka_broker.url,
           "TRAINSCOPE_WINDOW_S": str(WINDOW_S), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    out = tmp_path / "job.out"
    with out.open("wb") as sink:
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(WORLD), str(script), job_id, str(SLOW_RANK), str(sleep_s), str(ONSET_S),
             str(MAX_TRAIN_S), str(stop), str(stall_s)],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
            start_new_session=True,
        )
    flagged_while_running = False
    try:
        deadline = time.monotonic() + MAX_TRAIN_S + 30
        while job.poll() is None and time.monotonic() < deadline:
            if f"{fault}: rank {SLOW_RANK} " in pipeline.out_text():
                flagged_while_running = job.poll() is None
                break
            time.sleep(0.2)
        # The flag starts the closed loop: rank 2 profiled against a peer, the call path stored
        # (its own line: a busy host may get another rank profiled too).
        while (fault == "straggler"
               and f"CALL PATH {job_id}: rank {SLOW_RANK} " not in pipeline.out_text()
               and job.poll() is None and time.monotonic() < deadline):
            time.sleep(0.5)
        stop.touch()
        code = job.wait(timeout=120)
        output = out.read_text(errors="replace")
        assert code == 0, output[-3000:]
        time.sleep(2)
        assert pipeline.terminate() == 0, pipeline.err_text()[-3000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(30)
        if pipeline.process.poll() is None:
            pipeline.kill()

    reports = {r["rank"]: r for r in (json.loads(line) for line in output.splitlines()
                                      if line.startswith("{"))}
    assert sorted(reports) == list(range(WORLD)), output[-3000:]
    assert all(r["errors"] == 0 for r in reports.values()), reports
    onset_ns = reports[SLOW_RANK]["onset_ns"]
    alerts = [line for line in pipeline.out_text().splitlines() if line.startswith("ALERT")]
    assert flagged_while_running, (alerts, pipeline.err_text()[-1000:],
                                   _step_times(store, job_id, onset_ns))
    tables = dump_tables(store, ("findings", "finding_call_paths"))
    rows = [ast.literal_eval(r) for r in tables["findings"]]
    # (detector, rank, ranks, category, score, evidence)
    early = [(r[4], r[5], r[6], r[11], r[12], r[13]) for r in rows if r[4] == "early"]
    print(f"\nearly flags: {early}\nALERT lines: {alerts}")
    assert [(e[1], e[2], e[3]) for e in early] == [(SLOW_RANK, [SLOW_RANK], fault)], early
    evidence = early[0][5]
    delay_s = (evidence["flagged_at_ns"] - onset_ns) / 1e9
    print(f"flagged {delay_s:.1f} s after the onset")
    assert 0 < delay_s <= MAX_FLAG_DELAY_S, (delay_s, evidence)
    if fault == "straggler":
        # The peers waited about the sleep per step for it (give or take a busy 2-core host).
        assert 0.5 * SLEEP_S * 1e3 <= evidence["peers_waited_ms"] <= 3 * SLEEP_S * 1e3, evidence
        paths = [ast.literal_eval(r) for r in tables["finding_call_paths"]]
        profiled = [(r[16], r[-1]) for r in paths if r[4] == "early" and r[5] == SLOW_RANK]
        assert profiled, tables["finding_call_paths"]
        path, message = profiled[0]
        assert path[0].startswith("train.py(") and "sleep" in path[-1], profiled
        assert message.startswith(f"rank {SLOW_RANK} spends +"), profiled
    else:
        # Flagged while the stall lasted, every peer waiting for it, none silent.
        assert delay_s < STALL_S, evidence
        assert evidence["peers_waiting"] == WORLD - 1 and evidence["silent"] == 0, evidence


def _step_times(store: Path, job_id: str, onset_ns: int) -> str:
    """What the early flag judged, for a failure's message: each rank's steps before and after
    the onset, their step and collective times (p10/p50/p90 ms)."""
    rows = query_store(store, f"""
        SELECT rank, start_ns >= {onset_ns} AS after, count() AS steps,
               arrayMap(q -> round(q / 1e6, 1),
                        quantiles(0.1, 0.5, 0.9)(duration_ns)) AS step_ms,
               arrayMap(q -> round(q / 1e6, 1),
                        quantiles(0.1, 0.5, 0.9)(collective_ns)) AS collective_ms
        FROM step_records WHERE job_id = '{job_id}' GROUP BY rank, after ORDER BY after, rank""")
    return "\n".join(f"rank {r} {'after' if a else 'before'} onset: {n} steps, step ms {s}, "
                     f"collective ms {c}" for r, a, n, s, c in rows)
