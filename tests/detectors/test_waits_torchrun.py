"""Who makes the others wait, on real processes: a straggler outside every hook is found.

Two 4-rank gloo DDP jobs on CPU under ``torchrun``, each with ``trainscope.attach()`` and
``trainscope.step()``, run side by side over the real broker; ``trainscope pipeline`` is its own
process. In the first, rank 2 sleeps 30 ms per step inside a ``record_function("preprocess")``
block in the loop body — outside ``forward`` and every other hooked function, so none of its
measured functions grows; its peers wait for it in DDP's all-reduce. The ``waits`` detector
must name rank 2 as ``host`` (outside instrumented code) at alert level, and the closed loop,
profiling rank 2 against a peer on its first alert, must name the block and the sleep in it,
shown by the dashboard beside the host finding; in the second job, the same code without the
sleep, the detector must raise nothing.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_procs import PipelineProcess, dashboard_findings, diagnose_store, dump_tables

from trainscope.detectors.base import ALERT_THRESHOLD

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORLD = 4
SLOW_RANK = 2
SLEEP_S = 0.03
WINDOW_S = 2.0
TRAIN_S = 7.0  # windows of 2 s: three whole windows of steady training
MAX_TRAIN_S = 60.0  # the slow job's own budget, should its profile never come

SCRIPT = r'''
import json, sys, time

import torch
import torch.distributed as dist

import trainscope

from pathlib import Path

JOB, TRAIN_S, SLOW_RANK, SLEEP_S = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), \
    float(sys.argv[4])
STOP = Path(sys.argv[5])

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
steps = 0
while not stop.item():
    for x, y in loader:
        steps += 1
        with trainscope.step(samples=len(x)):
            with torch.profiler.record_function("preprocess"):
                if rank == SLOW_RANK:
                    time.sleep(SLEEP_S)  # the injected fault: loop-body code no hook times
                x = x * 1.0
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if steps % 10 == 0:  # rank 0 decides, every rank stops at the same step
            stop.fill_(float(rank == 0 and (STOP.exists() or time.monotonic() - started > TRAIN_S)))
            dist.broadcast(stop, src=0)
            if stop.item():
                break
handle.detach()
stats = handle.stats()
# One write per report: unbuffered, print() writes the line and its end apart and
# the ranks' reports interleave on the launcher's stdout.
sys.stdout.write(json.dumps({"rank": rank, "steps": steps, "errors": stats["errors"],
                              "records_dropped": stats["records_dropped"]}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
'''


def _torchrun(script: Path, job_id: str, slow_rank: int, train_s: float, stop: Path,
              env: dict[str, str], out: Path) -> subprocess.Popen[bytes]:
    # --standalone: each job's rendezvous on a port of its own. A session of its own, so that
    # cleanup can end the ranks with their launcher.
    with out.open("wb") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", str(WORLD), str(script), job_id, str(train_s), str(slow_rank),
             str(SLEEP_S), str(stop)],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=script.parent,
            start_new_session=True,
        )


def test_a_straggler_outside_the_hooks_is_named_and_a_healthy_job_is_not(
        fresh_kafka_broker, tmp_path: Path) -> None:
    started = time.monotonic()
    slow_job, healthy_job = f"waits-slow-{os.getpid()}", f"waits-healthy-{os.getpid()}"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    store = tmp_path / "store"
    pipeline = PipelineProcess(
        fresh_kafka_broker.url, store, f"pipeline-{slow_job}",
        "--window-s", str(WINDOW_S), "--lateness-s", "2", "--commit-interval-s", "1",
        "--close-idle-s", "3", "--source-idle-s", "1", "--drain-on-stop",
        logs=tmp_path / "pipeline",
    )
    env = {**os.environ, "TRAINSCOPE_BUS": fresh_kafka_broker.url,
           "TRAINSCOPE_WINDOW_S": str(WINDOW_S), "OMP_NUM_THREADS": "1",
           # A rank that dies of a signal prints its threads' stacks.
           "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    jobs: list[subprocess.Popen[bytes]] = []
    try:
        # One after the other: side by side, 8 busy ranks on a 2-core machine make one of the
        # healthy job's ranks really late (CPU contention), and this test is about the sleep.
        # The slow job runs until the closed loop has profiled rank 2 (its CALL PATH line; a
        # busy host may get another rank profiled first), the healthy one for TRAIN_S.
        for job_id, slow_rank, train_s in ((slow_job, SLOW_RANK, MAX_TRAIN_S),
                                           (healthy_job, -1, TRAIN_S)):
            stop = tmp_path / f"{job_id}.stop"
            jobs.append(_torchrun(script, job_id, slow_rank, train_s, stop, env,
                                  tmp_path / f"{job_id}.out"))
            if job_id == slow_job:
                deadline = time.monotonic() + MAX_TRAIN_S
                while (f"CALL PATH {slow_job}: rank {SLOW_RANK} " not in pipeline.out_text()
                       and jobs[-1].poll() is None and time.monotonic() < deadline):
                    time.sleep(0.5)
                stop.touch()
            try:
                code = jobs[-1].wait(timeout=120)
            except subprocess.TimeoutExpired:
                code = None  # what the ranks printed says where they stand
            output = (tmp_path / f"{job_id}.out").read_text(errors="replace")
            assert code == 0, f"{job_id} exited {code}:\n{output[-3000:]}"
            reports = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
            assert sorted(r["rank"] for r in reports) == list(range(WORLD)), output[-3000:]
            assert all(r["errors"] == 0 and r["records_dropped"] == 0 for r in reports), reports
        time.sleep(2)  # the producers' last flush is on the bus; SIGTERM drains the rest
        assert pipeline.terminate() == 0, pipeline.err_text()[-3000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)  # the launcher and its ranks
                job.wait(30)
        if pipeline.process.poll() is None:
            pipeline.kill()

    slow = diagnose_store(store, slow_job, "waits")
    healthy = diagnose_store(store, healthy_job, "waits")
    # Each window's finding: (job, rank, category, score, peers' wait in ms/step).
    tables = dump_tables(store, ("findings", "finding_call_paths"))
    rows = [ast.literal_eval(r) for r in tables["findings"]]
    paths = [ast.literal_eval(r) for r in tables["finding_call_paths"]]
    # A late rank's finding carries its peers' wait, a job-level one (turns) its members'.
    waits = [(r[1], r[5], r[11], r[12],
              r[13].get("peers_wait_ns_per_step", r[13].get("wait_ns_per_step", 0.0)) / 1e6,
              r[13].get("runqueue_wait_ns_per_step", 0.0) / 1e6)
             for r in rows if r[4] == "waits"]
    print(f"\nwaits findings (job, rank, category, score, wait ms/step, run-queue wait ms/step): "
          f"{waits}\n"
          f"slow job: {slow}\nhealthy job: {healthy}\n{time.monotonic() - started:.1f} s")
    assert [(s["rank"], s["category"]) for s in slow["suspects"]] == [(SLOW_RANK, "host")], slow
    top = slow["suspects"][0]
    assert top["score"] >= ALERT_THRESHOLD and top["function"] == "ddp_allreduce", top
    assert "outside instrumented code" in top["message"], top
    alerts = [w for w in waits if w[0] == slow_job and w[3] >= ALERT_THRESHOLD]
    assert len(alerts) >= 2 and {w[1:3] for w in alerts} == {(SLOW_RANK, "host")}, waits
    # The sleep is 30 ms per step: what its peers wait for it, give or take the busy host (a
    # window the job ended in holds only part of its steps' spans).
    assert 20 <= statistics.median(w[4] for w in alerts) <= 40, waits
    # The healthy job names no rank and no uneven data. Should the machine get busy beside it
    # (4 ranks on 2 cores, and whatever else runs), its ranks take turns waiting for a CPU:
    # that, and only with the run-queue wait measured, is said for the job as a whole. A rank
    # the busy host made late for one window, or whose own functions explain its lateness, is
    # kept as evidence below the alert threshold (a hiccup does not persist), never an alert.
    healthy_waits = [w for w in waits if w[0] == healthy_job]
    assert all(w[1] == -1 and w[2] == "cpu-contention" and w[5] > 0
               for w in healthy_waits if w[1] == -1 or w[3] >= ALERT_THRESHOLD), waits
    assert all(s["category"] == "cpu-contention" and s["rank"] == -1
               for s in healthy["suspects"]), healthy
    # The closed loop profiled rank 2 against a healthy peer on its first alert - the host
    # finding, or on a busy machine another detector's view of the same rank (its run-queue
    # wait as cpu-contention) a window earlier: the call path that differs names the block
    # and the sleep in it, at ~30 ms per step.
    profiled = [(r[16], r[-1]) for r in paths if r[1] == slow_job and r[5] == SLOW_RANK]
    assert profiled, tables["finding_call_paths"]
    path, message = profiled[0]
    assert path[0].startswith("train.py(") and "preprocess" in path, profiled
    assert "sleep" in path[-1] and message.startswith("rank 2 spends +"), profiled
    # And the dashboard shows it beside the host finding, whichever finding it was asked for.
    shown = [f["call_path"] for f in dashboard_findings(store, slow_job)
             if (f["rank"], f["category"]) == (SLOW_RANK, "host")]
    assert shown and shown[0] is not None and shown[0]["path"] == path, (shown, profiled)
    assert 20 <= float(message.split("+")[1].split(" ms/step")[0]) <= 40, profiled
