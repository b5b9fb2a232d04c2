"""The closed loop end to end: a 3-rank gloo DDP job on CPU with ``trainscope.attach()``, a
real broker, and ``trainscope pipeline`` as a process of its own.

Rank 1 runs an extra ``record_function("extra_work")`` block in its forward. The stream job
finds it, asks rank 1 and a peer for a profile by itself, diffs the two call-path trees and
stores with the finding the call path of the extra work and its cost, which must agree with
what rank 1 measured inside the block over the steps the profile covered. A healthy job must
make the stream job ask for nothing: no control message is published at all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from pipeline_procs import PipelineProcess, host_contention

sys.path.insert(0, str(Path(__file__).parent))

import loop_jobs

from trainscope.schemas.codec import decode_batch
from trainscope.schemas.records import ControlMessage
from trainscope.transport.bus import CONTROL_TOPIC, open_bus

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

WORLD = 3
EXTRA_RANK = 1
STEPS = 5


def _run(url: str, tmp_path: Path, extra_rank: int, max_s: float
         ) -> tuple[str, PipelineProcess, list[dict]]:
    from kafka_broker import free_port

    job_id = f"loop-{uuid.uuid4().hex[:6]}"
    pipeline = PipelineProcess(
        url, tmp_path / "store", f"g-{job_id}", "--window-s", "2", "--lateness-s", "1",
        "--close-idle-s", "4", "--commit-interval-s", "1", "--auto-profile-steps", str(STEPS),
        logs=tmp_path / "pipeline",
    )
    stop_file = tmp_path / "stop"
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(WORLD)]
    port = free_port()
    procs = [ctx.Process(target=loop_jobs.run_rank,
                         args=(r, WORLD, port, url, job_id, extra_rank, str(stop_file), max_s,
                               pipes[r][1]))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    results: list[dict] = []
    try:
        deadline = time.monotonic() + max_s + 60
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            # The job stops once the stream job said it stored the call path.
            if not stop_file.exists() and "CALL PATH" in pipeline.out_text():
                stop_file.touch()
            for reader, _ in pipes:
                if reader.poll():
                    results.append(reader.recv())
            time.sleep(0.2)
        for p in procs:
            p.join(10)
        for reader, _ in pipes:
            while reader.poll():
                results.append(reader.recv())
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        # The last windows close once the job is idle; then stop the stream job.
        time.sleep(6)
        assert pipeline.terminate() == 0, pipeline.err_text()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if pipeline.process.poll() is None:
            pipeline.kill()
    assert "Traceback" not in pipeline.err_text(), pipeline.err_text()
    return job_id, pipeline, sorted(results, key=lambda r: r["rank"])


_QUERY = r"""
import json, sys
from trainscope.store.client import connect
client = connect(sys.argv[1])
job = sys.argv[2]
out = {}
for name, sql in {
    "loop": "SELECT * FROM finding_call_paths FINAL WHERE job_id = {job:String}",
    "findings": "SELECT window_start_ns, detector, rank, category, score FROM findings FINAL "
                "WHERE job_id = {job:String}",
    "paths": "SELECT rank, path, total_ns, steps FROM call_paths FINAL "
             "WHERE job_id = {job:String} AND name = 'extra_work'",
    "sessions": "SELECT DISTINCT rank, window_start_ns FROM call_paths FINAL "
                "WHERE job_id = {job:String}",
}.items():
    result = client.query(sql, parameters={"job": job})
    out[name] = [dict(zip(result.column_names, row)) for row in result.result_rows]
print(json.dumps(out, default=str))
"""


def _store(store: Path, job_id: str) -> dict[str, list[dict]]:
    done = subprocess.run([sys.executable, "-c", _QUERY, str(store), job_id],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _control_messages(url: str, job_id: str) -> list[ControlMessage]:
    """Every control message on the topic for ``job_id``, read from the beginning."""
    bus = open_bus(url)
    try:
        consumer = bus.consumer([CONTROL_TOPIC], f"check-{uuid.uuid4().hex[:6]}")
        found: list[ControlMessage] = []
        quiet = 0
        while quiet < 3:
            messages = consumer.poll(timeout_s=1.0)
            quiet = 0 if messages else quiet + 1
            found += [r for m in messages for r in decode_batch(m.value)
                      if isinstance(r, ControlMessage) and r.job_id == job_id]
        consumer.close()
        return found
    finally:
        bus.close()


def test_a_slow_rank_gets_profiled_and_its_finding_carries_the_call_path(
    fresh_kafka_broker, tmp_path
) -> None:
    url = fresh_kafka_broker.url
    job_id, pipeline, results = _run(url, tmp_path, EXTRA_RANK, max_s=60)
    out = pipeline.out_text()
    print(out)
    assert len(results) == WORLD
    for r in results:
        assert r["stats"]["errors"] == 0, r["stats"]["errors_by_kind"]
    # The stream job asked rank 1 (suspect) and one peer, once: the rate limit holds.
    asked = _control_messages(url, job_id)
    assert len(asked) == 2, asked
    assert {m.rank for m in asked} >= {EXTRA_RANK}
    (peer,) = {m.rank for m in asked} - {EXTRA_RANK}
    assert f"PROFILE {job_id}: asked rank {EXTRA_RANK}" in out
    # Both for the same K steps: --auto-profile-steps, or more when the suspect's window held
    # a few steps over twice its median, which is how an intermittent straggler looks (and
    # how this rank looks when the loaded test host stalls it now and then; CI saw 50).
    (steps,) = {m.steps for m in asked}
    assert steps == STEPS or (STEPS < steps <= 50 and "slow steps come now and then" in out)
    # Both ranks profiled themselves for exactly K steps; nobody else did.
    profiled = {r["rank"]: r["reports"] for r in results if r["reports"]}
    assert set(profiled) == {EXTRA_RANK, peer}
    assert all(rep[0][3] == steps for rep in profiled.values())

    tables = _store(tmp_path / "store", job_id)
    (row,) = tables["loop"]
    assert row["rank"] == EXTRA_RANK and row["peer_rank"] == peer and row["steps"] == steps
    # The finding it belongs to is in the store.
    assert any(f["window_start_ns"] == row["window_start_ns"] and f["rank"] == EXTRA_RANK
               and f["detector"] == row["detector"] and f["score"] >= 0.5
               for f in tables["findings"])
    # The call path reaches into the extra work, and its cost per step is what rank 1
    # measured inside the block over the profiled steps.
    path = row["path"]
    assert "extra_work" in path, path
    at = path.index("extra_work")
    assert row["path_layers"][at] == "user_annotation"
    assert any("forward" in name for name in path[:at]), path
    _, started_ns, stopped_ns, _ = profiled[EXTRA_RANK][0]
    blocks = [ns for t, ns in results[EXTRA_RANK]["extra_blocks"] if started_ns <= t <= stopped_ns]
    assert len(blocks) == steps
    measured_ns = sum(blocks) / steps
    stored_ns = row["path_delta_ns"][at]
    print(f"extra_work: stored {stored_ns / 1e6:.3f} ms/step, measured {measured_ns / 1e6:.3f}")
    # The stored figure is the record_function's span, which ends after the block's own clock
    # stopped: a hand-off of the GIL in between (another thread of the rank runs; at most a
    # switch interval, 5 ms, each time) lands in it alone. On a busy 2-core host one did in
    # a CI run (+3.3 ms over the 5 steps), so two are allowed above, none below.
    handoffs_ns = 2 * sys.getswitchinterval() * 1e9 / steps
    assert 0.98 * measured_ns <= stored_ns <= 1.02 * measured_ns + handoffs_ns
    assert row["delta_ns"] > 0.9 * measured_ns
    assert f"CALL PATH {job_id}: rank {EXTRA_RANK}" in out and "extra_work" in out
    # Both profiles' trees are in call_paths; only the suspect's has the block.
    assert {s["rank"] for s in tables["sessions"]} == {EXTRA_RANK, peer}
    assert {p["rank"] for p in tables["paths"]} == {EXTRA_RANK}
    assert pipeline.stats()["profile_parts"] >= 2


def test_a_healthy_job_triggers_no_profiling(fresh_kafka_broker, tmp_path) -> None:
    url = fresh_kafka_broker.url
    job_id, pipeline, results = _run(url, tmp_path, extra_rank=-1, max_s=16)
    out = pipeline.out_text()
    print(out)
    assert len(results) == WORLD
    assert _control_messages(url, job_id) == []
    assert "PROFILE" not in out and "CALL PATH" not in out
    assert all(r["stats"]["profile"]["requested"] == 0 for r in results)
    tables = _store(tmp_path / "store", job_id)
    assert tables["loop"] == [] and tables["sessions"] == []
    # The job was watched: its windows are in the store, just without alerts (but the host's
    # contention, should the machine get busy beside the job).
    assert all(f["score"] < 0.5 or host_contention(f) for f in tables["findings"]), \
        tables["findings"]
    assert pipeline.stats()["auto_profile"]["requested"] == 0
