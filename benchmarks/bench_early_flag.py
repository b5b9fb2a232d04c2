"""How soon a real job's straggler or stalled rank is flagged, at 1-s steps, before its window
closes.

Each case is a 4-rank gloo DDP job on CPU under ``torchrun`` with ``trainscope.attach()``;
every rank's step is ``--step-s`` long (a sleep in the loop body plus a small model's step);
``trainscope pipeline`` runs as its own process over a real Kafka-protocol broker with 15-s
windows. After ``--onset-s`` of steady training rank 2

  stall       stops once for ``--stall-s`` in the loop body: no step ends anywhere, its peers
              wait in DDP's all-reduce, the producers report the open step
  straggler   takes ``--factor`` times as long per step from then on (the extra as a sleep in
              the loop body, outside every hooked function)

The figure is the time from the onset (rank 2's clock, when its fault began) to the early
flag: when the flagged step ended or the stall report was sent (``flagged_at_ns``, the job's
clock), and when the pipeline printed its ``ALERT`` line (this process's clock, the same
host's). Beside it, the first window detectors' alert naming rank 2 and when its window closed.

Run:  python benchmarks/bench_early_flag.py [--cases stall,straggler] [--step-s 1] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench_fault_matrix import chosen_cases, run_cases

WORLD = 4
SLOW_RANK = 2
WINDOW_S = 15.0
CASES = ("stall", "straggler")

RANK_SCRIPT = r'''
import json, sys, time

import torch
import torch.distributed as dist

import trainscope

JOB, CASE = sys.argv[1], sys.argv[2]
STEP_S, ONSET_S, STALL_S, FACTOR, TRAIN_S = map(float, sys.argv[3:8])
SLOW_RANK = 2

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
handle = trainscope.attach(job_id=JOB)
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
                    if CASE == "stall":
                        time.sleep(STALL_S)
                if CASE == "straggler":
                    time.sleep(STEP_S * (FACTOR - 1))
            time.sleep(STEP_S)  # the step's work, in the loop body
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        stop.fill_(float(rank == 0 and time.monotonic() - started > TRAIN_S))
        dist.broadcast(stop, src=0)
        if stop.item():
            break
handle.detach()
sys.stdout.write(json.dumps({"rank": rank, "steps": steps, "onset_ns": onset_ns,
                             "errors": handle.stats()["errors"]}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
'''

QUERY = r'''
import json, sys
from trainscope.detectors.base import ALERT_THRESHOLD
from trainscope.sinks.clickhouse import connect

client = connect(sys.argv[1])
out = {}
for job in sys.argv[2:]:
    rows = client.query(
        "SELECT detector, rank, category, score, window_end_ns, evidence FROM findings "
        "WHERE job_id = {job:String} AND score >= {t:Float64} ORDER BY window_end_ns",
        parameters={"job": job, "t": ALERT_THRESHOLD}).result_rows
    out[job] = [{"detector": d, "rank": r, "category": c, "score": round(s, 2),
                 "window_end_ns": w, "flagged_at_ns": e.get("flagged_at_ns")}
                for d, r, c, s, w, e in rows]
print(json.dumps(out))
'''


def _run_case(case: str, job_id: str, args: argparse.Namespace, script: Path,
              env: dict[str, str], pipeline_out: Path, logs: Path) -> dict:
    train_s = args.onset_s + (args.stall_s if case == "stall" else 0.0) + args.after_s
    out = logs / f"{job_id}.out"
    seen = len(pipeline_out.read_text(errors="replace"))
    alert_ns = None
    with out.open("wb") as sink:
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(WORLD), str(script), job_id, case, str(args.step_s), str(args.onset_s),
             str(args.stall_s), str(args.factor), str(train_s)],
            stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=script.parent,
            start_new_session=True)
    wanted = f"{'hang' if case == 'stall' else 'straggler'}: rank {SLOW_RANK} "
    deadline = time.monotonic() + train_s + 180
    try:
        while job.poll() is None and time.monotonic() < deadline:
            if alert_ns is None and wanted in pipeline_out.read_text(errors="replace")[seen:]:
                alert_ns = time.time_ns()
            time.sleep(0.1)
        code = job.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        code = None
    text = out.read_text(errors="replace")
    reports = {r["rank"]: r for r in (json.loads(line) for line in text.splitlines()
                                      if line.startswith('{"rank"'))}
    if code != 0 or len(reports) != WORLD:
        print(f"  {case}: the job exited {code} with {len(reports)} rank reports:\n"
              f"{text[-2000:]}", file=sys.stderr)
    onset_ns = reports.get(SLOW_RANK, {}).get("onset_ns") or None
    return {"exit": code, "onset_ns": onset_ns, "alert_line_ns": alert_ns,
            "steps": sorted(r["steps"] for r in reports.values())}


def _summarise(case: str, run: dict, alerts: list[dict]) -> dict:
    onset_ns = run["onset_ns"]

    def after(ns: float | None) -> float | None:
        return None if ns is None or onset_ns is None else round((ns - onset_ns) / 1e9, 1)

    early = [a for a in alerts if a["detector"] == "early"]
    window = [a for a in alerts if a["detector"] != "early" and a["rank"] == SLOW_RANK
              and a["category"] not in ("straggler",)]
    first_window = window[0] if window else None
    return {
        "case": case,
        "steps": run["steps"],
        "early": [f"{a['rank']} {a['category']} [{a['score']}]" for a in early],
        "other_ranks_alerted": sorted({f"{a['rank']} {a['category']}" for a in alerts
                                       if a["rank"] not in (SLOW_RANK, -1)}),
        "s_to_flag": after(early[0]["flagged_at_ns"]) if early else None,
        "s_to_alert_line": after(run["alert_line_ns"]),
        "first_window_alert": (f"{first_window['rank']} {first_window['category']} "
                               f"({first_window['detector']})") if first_window else None,
        "s_to_window_close": after(first_window["window_end_ns"]) if first_window else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--step-s", type=float, default=1.0, help="each rank's step, seconds")
    parser.add_argument("--onset-s", type=float, default=16.0,
                        help="steady training before the fault (the flag needs 12 steps)")
    parser.add_argument("--stall-s", type=float, default=25.0)
    parser.add_argument("--factor", type=float, default=2.0, help="the straggler's slowdown")
    parser.add_argument("--after-s", type=float, default=32.0,
                        help="training after the fault's onset (after the stall): two whole "
                             "15-s windows, for the window detectors' confirmed alert")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    cases = chosen_cases(parser, args.cases, CASES)
    results = run_cases(
        cases, "early", RANK_SCRIPT, QUERY, _summarise, WINDOW_S,
        lambda case, job_id, script, env, work: _run_case(case, job_id, args, script, env,
                                                          work / "pipeline.out", work),
        "--no-auto-profile")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
