"""``trainscope ui`` in a real browser, over a store that a demo job with a slow GPU filled.

The store is made by the real commands (``trainscope demo`` with a fault, ``trainscope whatif``
on its op trace); the dashboard runs as its own process (chDB lets one process own a store) and
headless Chromium (Debian's ``chromium``, driven by Playwright) loads its pages. Screenshots go
into the test's output directory, and also into ``$TRAINSCOPE_SCREENSHOT_DIR`` when set (that is
how the README's picture is made).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from dashboard_procs import serve

CULPRIT = 5
LIVE_JOB = "team/live </script>job"  # a slash, a space, and markup that must stay text
CHROMIUM = "/usr/bin/chromium"


def trainscope(*args: str, timeout_s: float = 300) -> str:
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


CALL_PATH = ["python:train.py(42): step", "torch_op:forward", "user_annotation:extra_work"]
CALL_PATH_ROW = f"""
import sys
from trainscope.schemas.records import FindingCallPath
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
sink.write_finding_call_paths([FindingCallPath(
    job_id="demo-job", window_start_ns=1767225615 * 10**9, window_end_ns=1767225630 * 10**9,
    detector="peer-diff", rank={CULPRIT}, category="gpu-compute", score=1.0, peer_rank=4,
    request_id="r1", profiled_from_ns=1767225640 * 10**9, profiled_to_ns=1767225645 * 10**9,
    steps=5, per_step=True, path={[p.split(":", 1)[1] for p in CALL_PATH]!r},
    path_layers={[p.split(":", 1)[0] for p in CALL_PATH]!r}, path_delta_ns=[3.1e7, 3.0e7, 3.0e7],
    suspect_ns=3.2e7, peer_ns=2.0e6, delta_ns=3.0e7, message="extra_work +30 ms/step")])
sink.close()
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ui")
    path = root / "store"
    trainscope("demo", "--ranks", "16", "--dp", "4", "--pp", "2", "--tp", "2", "--steps", "80",
               "--fault", f"slow-gpu:rank={CULPRIT},factor=1.4", "--start-s", "1767225600",
               "--store", str(path), "--optrace", str(root / "ops"))
    trainscope("whatif", "--trace", str(root / "ops" / "optrace.parquet"), "--meta",
               str(root / "ops" / "optrace.yaml"), "--job", "demo-job", "--store", str(path))
    # What the stream job's automatic profile would have added for the culprit's finding
    # (a stand-in for the closed loop, which needs real training processes: tests/loop).
    subprocess.run([sys.executable, "-c", CALL_PATH_ROW, str(path)], check=True, timeout=120)
    # A second job that ends about half a minute from now: shown as running (a step within
    # the last 2 minutes) for the whole module, and its page keeps refreshing.
    trainscope("demo", "--ranks", "4", "--dp", "2", "--pp", "2", "--tp", "1", "--steps", "30",
               "--job-id", LIVE_JOB, "--start-s", str(int(time.time())), "--store", str(path))
    return path


@pytest.fixture(scope="module")
def dashboard(store: Path, tmp_path_factory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("ui-log") / "ui.log"
    with serve(store, log, "--refresh-s", "1") as url:
        yield url


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        reason = "Debian's chromium is not installed (infra/setup-test-host.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def screenshot(page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / name), full_page=True)
    extra = os.environ.get("TRAINSCOPE_SCREENSHOT_DIR")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, Path(extra) / name)


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def test_the_api_answers_from_clickhouse(dashboard: str) -> None:
    jobs = {j["job_id"]: j for j in get_json(dashboard + "/api/jobs")}
    assert set(jobs) == {"demo-job", LIVE_JOB}
    job = jobs["demo-job"]
    assert (job["job_id"], job["ranks"], job["status"]) == ("demo-job", 16, "ended")
    assert (jobs[LIVE_JOB]["ranks"], jobs[LIVE_JOB]["status"]) == (4, "running")
    assert job["suspects"] >= 1
    overview = get_json(dashboard + "/api/jobs/demo-job/overview")
    assert overview["findings"][0]["rank"] == CULPRIT
    assert overview["findings"][0]["function_name"] == "torch_op/backward"
    call_path = overview["findings"][0]["call_path"]
    assert call_path["path"] == [p.split(":", 1)[1] for p in CALL_PATH]
    assert (call_path["peer_rank"], call_path["delta_ns"]) == (4, 3.0e7)
    assert all(f["call_path"] is None for f in overview["findings"][1:])
    live = get_json(dashboard + "/api/jobs/" + urllib.parse.quote(LIVE_JOB, safe="")
                    + "/overview")
    assert all(f["call_path"] is None for f in live["findings"])
    assert len(overview["steps"]) == 80
    assert overview["whatif"]["S"] > 1.05
    heat = get_json(dashboard + "/api/jobs/demo-job/heatmap?layer=torch_op&name=backward")
    ranks, _columns, values = heat["cells"]
    slowest = max(range(len(values)), key=values.__getitem__)
    assert ranks[slowest] == CULPRIT
    assert len(set(ranks)) == 16
    assert heat["bucket_ms"] == 15_000 and heat["t0_ms"] == 1767225600_000
    with pytest.raises(urllib.error.HTTPError) as missing:
        get_json(dashboard + "/api/jobs/no-such-job/overview")
    assert missing.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as no_page:
        get_json(dashboard + "/jobs/no-such-job")
    assert no_page.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as bad:
        get_json(dashboard + "/api/jobs/demo-job/breakdown?rank=x&from_ms=0&to_ms=1")
    assert bad.value.code == 400 and b"rank='x'" in bad.value.read()


def test_the_jobs_page_lists_the_job_with_its_open_finding(
    dashboard: str, browser, tmp_path: Path
) -> None:
    page, errors = open_page(browser, dashboard + "/")
    rows = page.locator("#jobs tbody tr")
    assert rows.count() == 2
    texts = sorted(rows.nth(i).inner_text() for i in range(2))
    assert "demo-job" in texts[0] and "gpu-compute" in texts[0] and "ended" in texts[0]
    assert LIVE_JOB in texts[1] and "running" in texts[1]
    screenshot(page, tmp_path, "dashboard-jobs.png")
    assert errors == []


def test_the_job_page_points_at_the_culprit_and_a_click_opens_its_breakdown(
    dashboard: str, browser, tmp_path: Path
) -> None:
    page, errors = open_page(browser, dashboard + "/jobs/demo-job")
    page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
    for chart in ("steps", "heatmap", "workers"):
        assert page.locator(f"#{chart} .main-svg").count() > 0, f"{chart} not drawn"
    # The heatmap shows the function the top finding names; its hottest row is the culprit's,
    # and the culprit's row is outlined.
    assert page.input_value("#metric") == "torch_op/backward"
    hottest, outlined = page.evaluate("""() => {
        const gd = document.getElementById('heatmap');
        const {y, z} = gd.data[0];
        let best = [-1, -Infinity];
        z.forEach((row, i) => row.forEach(v => {
            if (v !== null && v > best[1]) best = [y[i], v];
        }));
        return [best[0], (gd.layout.shapes || []).map(s => (s.y0 + s.y1) / 2)];
    }""")
    assert hottest == CULPRIT
    assert outlined == [CULPRIT]
    assert f"suspect rank(s): {CULPRIT}" in page.inner_text("#suspects")
    assert "gpu-compute" in page.inner_text("#findings")
    assert ("call path (vs rank 4): train.py(42): step → forward → extra_work +30.0 ms/step"
            in page.inner_text("#findings .callpath"))
    assert "Slowdown S" in page.inner_text("#whatif")
    assert page.inner_text("#status") == "ended"
    assert "16 ranks, steps 0–79" in page.inner_text("#summary")

    # A real click on the culprit's cell in the middle of the job.
    x, y = page.evaluate("""(rank) => {
        const gd = document.getElementById('heatmap');
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const xs = gd.data[0].x, t = xs[Math.floor(xs.length / 2)];
        return [xa._offset + xa.l2p(xa.d2l(t)), ya._offset + ya.l2p(ya.d2l(rank))];
    }""", CULPRIT)
    box = page.locator("#heatmap").bounding_box()
    page.mouse.click(box["x"] + x, box["y"] + y)
    page.wait_for_selector(f"#breakdown[data-rank='{CULPRIT}'] .main-svg", timeout=10_000)
    names, rank_ms, peer_ms = page.evaluate("""() => {
        const d = document.getElementById('breakdown').data;
        return [d[0].x, d[0].y, d[1].y];
    }""")
    assert names[0] == "torch_op/backward"
    assert rank_ms[0] > 1.2 * peer_ms[0]
    assert f"rank {CULPRIT} vs its peers" in page.inner_text("#breakdown")
    page.locator("#breakdown").scroll_into_view_if_needed()
    screenshot(page, tmp_path, "dashboard-job.png")
    assert errors == []


def test_the_dashboards_default_threshold_is_the_detectors_alert_threshold() -> None:
    from trainscope.cli import ui as cli
    from trainscope.detectors.base import ALERT_THRESHOLD

    assert cli.ALERT_THRESHOLD == ALERT_THRESHOLD


def test_a_running_jobs_page_refreshes_itself(dashboard: str, browser) -> None:
    page, errors = open_page(browser, dashboard + "/jobs/" + urllib.parse.quote(LIVE_JOB, safe=""))
    page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
    assert page.inner_text("#status") == "running"
    # --refresh-s 1: the page fetches its data again by itself.
    page.wait_for_function("Number(document.body.dataset.loads) >= 3", timeout=20_000)
    assert errors == []


def test_an_ended_jobs_page_loads_once_and_marks_the_window_an_alert_links_to(
    dashboard: str, browser
) -> None:
    # The link an alert carries (see trainscope.sinks.alert_book): the job and its window.
    from_ns = 1767225600 * 10**9 + 30 * 10**9
    page, errors = open_page(
        browser, f"{dashboard}/jobs/demo-job?from_ns={from_ns}&to_ns={from_ns + 15 * 10**9}"
    )
    page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
    marked = page.evaluate("document.getElementById('steps').layout.shapes.map(s => "
                           "[new Date(s.x0).getTime(), new Date(s.x1).getTime()])")
    assert marked == [[from_ns // 10**6, from_ns // 10**6 + 15_000]]
    page.wait_for_timeout(2500)  # two refresh intervals pass without a reload
    assert page.evaluate("document.body.dataset.loads") == "1"
    assert errors == []


def run_ui(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", "ui", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_mistyped_store_or_a_busy_port_is_one_error_line(tmp_path: Path) -> None:
    import socket

    done = run_ui("--store", str(tmp_path / "nowhere"))
    assert done.returncode == 1
    assert done.stderr.startswith("Error: no store at ") and done.stderr.count("\n") == 1
    assert "--create" not in done.stderr  # ui has no such option
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_ui("--store", str(tmp_path / "nowhere"), "--port", str(port))
    assert done.returncode == 1
    assert done.stderr == (f"Error: --bind 127.0.0.1 --port {port}: cannot listen there: "
                           "Address already in use\n")
