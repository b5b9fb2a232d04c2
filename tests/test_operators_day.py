"""An operator's day, in one test: a real job goes wrong, and everything an operator uses sees it
while the job is still running.

A 4-rank gloo DDP job on CPU under ``torchrun``, with ``trainscope.attach()`` and
``trainscope.step()``, whose rank 2 sleeps 50 ms in its own forward every step. Over a real Kafka
broker, ``trainscope pipeline`` (its own process) writes a chDB store and posts to a real
Alertmanager, whose webhook the test serves; ``trainscope ui`` serves the dashboard from the
store the pipeline owns, through the pipeline's read-only endpoint. While ``torchrun`` still
runs: the alert arrives naming rank 2, headless Chromium opens the alert's ``dashboard`` link
and the page shows the job running with rank 2 as the suspect, and ``trainscope sql`` returns
rank 2's finding. Then the job ends, exits 0, and the page says it ended; the job sent its op
trace (``TRAINSCOPE_OPTRACE=1``), and ``trainscope whatif --job`` on the store the pipeline still
owns puts the job's straggler slowdown on rank 2's forward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from alertmanager_proc import Alertmanager, WebhookReceiver, free_port, require_alertmanager
from pipeline_procs import PipelineProcess

from trainscope.store.live import ENDPOINT_FILE

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
WORLD = 4
SLOW_RANK = 2
WINDOW_S = 3.0
RUNNING_S = 15.0  # the ui's "running" horizon: above window + lateness + commit interval
MAX_TRAIN_S = 120.0  # the job's own budget, should the test never create the stop file

SCRIPT = r'''
import json, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

import trainscope

JOB, STOP = sys.argv[1], Path(sys.argv[2])
MAX_S, SLOW_RANK, EXTRA_S = float(sys.argv[3]), int(sys.argv[4]), 0.05

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
handle = trainscope.attach(job_id=JOB)  # bus and window from TRAINSCOPE_BUS / _WINDOW_S
assert handle is not None


class Net(torch.nn.Module):
    def __init__(self, slow):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                        torch.nn.Linear(128, 1))
        self.slow = slow

    def forward(self, x):
        if self.slow:
            time.sleep(EXTRA_S)  # the injected fault: this rank's own code is slow
        return self.body(x)


model = torch.nn.parallel.DistributedDataParallel(Net(rank == SLOW_RANK))
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
# One write per report: unbuffered, print() writes the line and its end apart and
# the ranks' reports interleave on the launcher's stdout.
sys.stdout.write(json.dumps({"rank": rank, "steps": steps, "errors": stats["errors"],
                              "records_sent": stats["records_sent"],
                              "records_dropped": stats["records_dropped"]}) + "\n")
sys.stdout.flush()
dist.destroy_process_group()
'''


def _wait(condition, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def _get_json(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except OSError:
        return None


def _firing_for(job_id: str):
    def pick(notifications: list[dict]) -> list[dict]:
        return [alert for n in notifications if n["status"] == "firing"
                for alert in n["alerts"] if alert["labels"].get("job_id") == job_id]
    return pick


def test_an_operators_day(fresh_kafka_broker, tmp_path: Path) -> None:
    require_alertmanager()
    if not Path(CHROMIUM).exists():
        reason = "Debian's chromium is not installed (infra/setup-test-host.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    job_id = f"operators-day-{os.getpid()}"
    store = tmp_path / "store"
    stop_file = tmp_path / "stop"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ui_port = free_port()
    dashboard = f"http://127.0.0.1:{ui_port}"
    (tmp_path / "am").mkdir()
    cleanup: list = []
    with WebhookReceiver() as webhook:
        manager = Alertmanager(tmp_path / "am", webhook.url)
        cleanup.append(manager.stop)
        try:
            manager.wait_ready()
            pipeline = PipelineProcess(
                fresh_kafka_broker.url, store, f"pipeline-{job_id}",
                "--window-s", str(WINDOW_S), "--lateness-s", "2", "--commit-interval-s", "1",
                "--close-idle-s", "3", "--source-idle-s", "1",
                "--alertmanager", manager.url, "--dashboard-url", dashboard,
                logs=tmp_path / "pipeline",
            )
            cleanup.append(lambda: pipeline.process.poll() is None and pipeline.terminate())
            _wait(lambda: (store / ENDPOINT_FILE).exists() or pipeline.process.poll() is not None,
                  60, "the pipeline's read endpoint")
            assert pipeline.process.poll() is None, pipeline.err_text()

            ui_log = (tmp_path / "ui.log").open("wb")
            ui = subprocess.Popen(
                [sys.executable, "-m", "trainscope.cli.main", "ui", "--store", str(store),
                 "--port", str(ui_port), "--refresh-s", "2", "--running-s", str(RUNNING_S)],
                stdout=ui_log, stderr=subprocess.STDOUT,
            )
            cleanup.append(lambda: (ui.terminate(), ui.wait(30), ui_log.close()))
            _wait(lambda: _get_json(dashboard + "/api/jobs") is not None
                  or ui.poll() is not None, 60, "the dashboard")
            assert ui.poll() is None, (tmp_path / "ui.log").read_text()

            env = {**os.environ, "TRAINSCOPE_BUS": fresh_kafka_broker.url,
                   "TRAINSCOPE_WINDOW_S": str(WINDOW_S), "OMP_NUM_THREADS": "1",
                   "TRAINSCOPE_OPTRACE": "1",
                   # A rank that dies of a signal prints its threads' stacks.
                   "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
            job_out = (tmp_path / "torchrun.out").open("wb")
            job_err = tmp_path / "torchrun.err"
            started = time.monotonic()
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", str(WORLD), str(script), job_id, str(stop_file),
                 str(MAX_TRAIN_S), str(SLOW_RANK)],
                stdout=job_out, stderr=job_err.open("wb"), env=env, cwd=tmp_path,
            )
            cleanup.append(lambda: job.poll() is None and (job.kill(), job.wait(30)))

            def running(what: str) -> None:
                assert job.poll() is None, (
                    f"the job exited ({job.returncode}) before {what}:\n{job_err.read_text()}")

            # 1. The alert reaches the webhook, naming rank 2.
            alerts = _firing_for(job_id)(webhook.wait_for(_firing_for(job_id), timeout_s=90))
            assert alerts, (f"no alert; pipeline:\n{pipeline.err_text()[-3000:]}\n"
                            f"job:\n{job_err.read_text()[-3000:]}")
            running("the alert")
            to_alert_s = time.monotonic() - started
            ranks = {a["labels"].get("rank") for a in alerts}
            assert ranks == {str(SLOW_RANK)}, [a["labels"] for a in alerts]
            link = alerts[0]["annotations"]["dashboard"]
            assert link.startswith(f"{dashboard}/jobs/{job_id}?"), link

            # 2. The alert's link, in a browser: the job is running, rank 2 is the suspect.
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
                try:
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    errors: list[str] = []
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    page.goto(link)
                    page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
                    assert page.inner_text("#status") == "running"
                    assert page.inner_text("#suspects") == f"suspect rank(s): {SLOW_RANK}"
                    assert f"{WORLD} ranks" in page.inner_text("#summary")
                    running("the dashboard")
                    to_dashboard_s = time.monotonic() - started

                    # 3. SQL on the store the pipeline owns, through its endpoint.
                    sql = subprocess.run(
                        [sys.executable, "-m", "trainscope.cli.main", "sql", "--store",
                         str(store), "--format", "json",
                         "SELECT rank, category, detector, score, victims FROM findings "
                         f"WHERE job_id = '{job_id}' AND score >= 0.5 ORDER BY score DESC"],
                        capture_output=True, text=True, timeout=60, check=False,
                    )
                    assert sql.returncode == 0, sql.stderr
                    rows = [json.loads(line) for line in sql.stdout.splitlines() if line]
                    running("the SQL query")
                    to_sql_s = time.monotonic() - started
                    print(f"\nfindings: {rows}")
                    assert rows, sql.stdout
                    assert {r["rank"] for r in rows} == {SLOW_RANK}, rows
                    # A CPU-only job: no GPU evidence, so its own compute is "compute".
                    assert {r["category"] for r in rows} == {"compute"}, rows
                    victims = set(range(WORLD)) - {SLOW_RANK}
                    assert any(victims <= set(r["victims"]) for r in rows), rows

                    # 4. The job ends; the page says so.
                    stop_file.touch()
                    assert job.wait(timeout=60) == 0, job_err.read_text()[-3000:]
                    job_out.close()
                    reports = [json.loads(line) for line in
                               (tmp_path / "torchrun.out").read_text().splitlines()
                               if line.startswith("{")]
                    assert sorted(r["rank"] for r in reports) == list(range(WORLD)), reports
                    for r in reports:
                        assert r["errors"] == 0 and r["records_dropped"] == 0, r

                    def ended() -> bool:
                        page.reload()
                        page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
                        return page.inner_text("#status") == "ended"

                    _wait(ended, RUNNING_S + 30, "the page to say the job ended", every_s=2)
                    assert page.inner_text("#suspects") == f"suspect rank(s): {SLOW_RANK}"
                    assert errors == [], errors
                finally:
                    browser.close()

            # 5. The what-if of the job's own op trace, from the store the pipeline owns.
            _check_what_if(store, job_id)
            print(f"seconds from job start: alert {to_alert_s:.1f}, dashboard "
                  f"{to_dashboard_s:.1f}, sql {to_sql_s:.1f}, ended page "
                  f"{time.monotonic() - started:.1f}")
        finally:
            for step in reversed(cleanup):
                step()


def _check_what_if(store: Path, job_id: str) -> None:
    def analysed() -> dict | None:
        done = subprocess.run(
            [sys.executable, "-m", "trainscope.cli.main", "whatif", "--job", job_id, "--store",
             str(store), "--json"], capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            assert "no op trace in the store" in done.stderr, done.stderr  # not stored yet
            return None
        assert "result not stored: process" in done.stderr, done.stderr  # the pipeline owns it
        return json.loads(done.stdout)

    result = _wait(analysed, 60, f"the op trace of {job_id} in the store")
    worst = result["S_worker"][0]
    print(f"what-if: S {result['S']:.2f}, most suspect {worst}, by op type "
          f"{result['S_optype']}")
    assert result["workers"] == WORLD and result["fit"] == 0, result
    assert (worst["dp_rank"], worst["stage"]) == (SLOW_RANK, 0), result["S_worker"]
    assert result["S"] > 1.5  # 50 ms a step of sleep on one rank of four
    assert max(result["S_optype"], key=result["S_optype"].get) == "forward-compute"
