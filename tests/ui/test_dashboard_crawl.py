"""A crawler over ``trainscope ui`` on every kind of store the product writes.

Each store is made by the real writers (``trainscope demo``, ``trainscope whatif``, the sink):
one the stream job wrote (the demo runs the pipeline's stream job and sink in its process), one
with only a what-if result, empty ones (no tables; tables without rows), one with only dead
letters, and one whose job ids and function names hold "/", "#", "..", "<a href>" and "<b>".
Two more come from ``trainscope pipeline`` as its own process over a real broker: the store it
left when it stopped, and a live one, which the dashboard reads through the running pipeline's
read-only endpoint while the pipeline goes on writing it.
On each, the dashboard runs as its own process; headless Chromium visits every page and every
link found on them, and every route of the app (enumerated from the app itself, so a new route
is crawled without touching this file) is requested: no 5xx, no console or page error, every
section without data says what would fill it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dashboard_procs import get, serve
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, publish, start_publisher

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
HOSTILE_JOB = "team/../run #1?x=<a href=x>HOSTILE-A</a> <b>HOSTILE-B</b> ü"
HOSTILE_FUNCTION = "back/../#ward <a href=x>HOSTILE-A</a><b>HOSTILE-B</b>"
# The sections of the job page; each shows data or one line saying what would fill it.
SECTIONS = ("steps", "heatmap", "breakdown", "findings", "whatif")
SVG_TEXT = ("text", "tspan")  # where Plotly draws labels (a <b> in a label: a bold tspan)


def trainscope(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def python(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=120)


def demo(store: Path, job: str, *extra: str) -> None:
    trainscope("demo", "--ranks", "16", "--dp", "4", "--pp", "2", "--tp", "2", "--steps", "40",
               "--job-id", job, "--fault", "slow-gpu:rank=5,factor=1.4", "--store", str(store),
               *extra)


NO_TABLES = """
import sys
from trainscope.store.client import connect
client = connect(sys.argv[1])
client.command("CREATE TABLE scratch (x UInt8) ENGINE = Memory")
client.command("DROP TABLE scratch")
"""

NO_ROWS = """
import sys
from trainscope.sinks.clickhouse import ClickHouseSink
ClickHouseSink.open(sys.argv[1]).close()
"""

DEAD_LETTERS = """
import sys
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
sink.write_dead_letter("trainscope.events", 0, 7, "rank 99 outside world size 16 <b>x</b>",
                       b"\\x00garbage")
sink.close()
"""

# Copies of the culprit's backward summaries and findings under a function name full of markup
# and URL syntax, as a producer could send it.
HOSTILE_ROWS = """
import sys
from trainscope.store.client import connect
client = connect(sys.argv[1])
name = sys.argv[2]
# (filtered in a subquery: in ClickHouse the alias "name" would shadow the column in WHERE)
client.command("INSERT INTO function_summaries SELECT * REPLACE ({name:String} AS name) "
               "FROM (SELECT * FROM function_summaries WHERE name = 'backward')",
               parameters={"name": name})
client.command("INSERT INTO findings SELECT * REPLACE ({name:String} AS function, "
               "concat(message, ' ', {name:String}) AS message) FROM findings",
               parameters={"name": name})
"""


def whatif_trace(root: Path, pp_size: int = 2) -> tuple[Path, Path]:
    from trainscope.whatif.generate import JobSpec, generate, write

    df, meta = generate(JobSpec(dp_size=2, pp_size=pp_size, microbatches=2, steps=3))
    trace, meta_path = root / f"ops-pp{pp_size}.parquet", root / f"ops-pp{pp_size}.yaml"
    write(df, meta, trace, meta_path)
    return trace, meta_path


@dataclass
class Store:
    path: Path
    # The job page's sections expected to say they are empty, per job.
    empty: dict[str, set[str]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Store]:
    root = tmp_path_factory.mktemp("crawl")
    made: dict[str, Store] = {}
    made["pipeline"] = Store(root / "pipeline", {"demo-job": {"whatif", "breakdown"}})
    demo(made["pipeline"].path, "demo-job")

    made["whatif-only"] = Store(root / "whatif-only",
                                {job: {"steps", "heatmap", "breakdown", "findings"}
                                 for job in ("wi-job", "wi-one-stage")})
    for job, pp_size in (("wi-job", 2), ("wi-one-stage", 1)):
        trace, meta = whatif_trace(root, pp_size)
        trainscope("whatif", "--trace", str(trace), "--meta", str(meta), "--job", job,
                   "--store", str(made["whatif-only"].path))

    for kind, code in (("no-tables", NO_TABLES), ("no-rows", NO_ROWS),
                       ("dead-letters", DEAD_LETTERS)):
        made[kind] = Store(root / kind)
        python(code, str(made[kind].path))

    hostile = made["hostile"] = Store(root / "hostile", {HOSTILE_JOB: {"breakdown"},
                                                         "..": {"whatif", "breakdown"}})
    demo(hostile.path, HOSTILE_JOB, "--optrace", str(root / "ops"))
    python(HOSTILE_ROWS, str(hostile.path), HOSTILE_FUNCTION)
    trainscope("whatif", "--trace", str(root / "ops" / "optrace.parquet"), "--meta",
               str(root / "ops" / "optrace.yaml"), "--job", HOSTILE_JOB, "--store",
               str(hostile.path))
    demo(hostile.path, "..")
    return made


# The pipeline's store kinds: small windows, so a few seconds of a job fill several.
PIPE_WINDOW_S = 2.0
SIM_STEP_S = 0.77  # event time of one simulated step (ClusterSpec defaults)
PIPE_JOB = ["--dp", "2", "--pp", "2", "--tp", "2", "--window-s", str(PIPE_WINDOW_S),
            "--fault", "slow-gpu:rank=5,factor=1.5"]
PIPE_ARGS = ["--window-s", str(PIPE_WINDOW_S), "--lateness-s", "0.5", "--commit-interval-s",
             "0.5", "--source-idle-s", "1"]
# Filled by the stream job alone: no what-if ran, and the breakdown waits for a click.
PIPE_EMPTY = {"whatif", "breakdown"}


def wait_for(condition, timeout_s: float, what: str, log: PipelineProcess) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert log.process.poll() is None, log.err_text()
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{log.err_text()}")


@pytest.fixture
def stopped_pipeline_store(tmp_path: Path) -> Iterator[Store]:
    """The store a ``trainscope pipeline`` process wrote and left when it stopped by itself."""
    store = Store(tmp_path / "store", {"proc-job": PIPE_EMPTY})
    with TansuBroker() as broker:
        publish(broker.url, "--job-id", "proc-job", "--steps", "40", *PIPE_JOB)
        pipeline = PipelineProcess(broker.url, store.path, "crawl", *PIPE_ARGS,
                                   "--close-idle-s", "1", "--idle-exit-s", "2",
                                   logs=tmp_path / "pipeline")
        assert pipeline.wait(120) == 0, pipeline.err_text()
    assert "Traceback" not in pipeline.err_text(), pipeline.err_text()
    yield store


@pytest.fixture
def live_store(tmp_path: Path) -> Iterator[Store]:
    """A store a running ``trainscope pipeline`` owns, a paced job still arriving; yielded once
    it holds the job's windows and a finding, so what each section shows is known."""
    from trainscope.store.live import read_endpoint

    store = Store(tmp_path / "store", {"live-job": PIPE_EMPTY})
    with TansuBroker() as broker:
        pipeline = PipelineProcess(broker.url, store.path, "crawl-live", *PIPE_ARGS,
                                   "--close-idle-s", "30", logs=tmp_path / "pipeline")
        publisher = start_publisher(
            broker.url, "--job-id", "live-job", "--steps", "1000", "--start-s",
            str(int(time.time())), "--steps-per-s", str(round(1 / SIM_STEP_S, 3)),
            "--flush-every", "1", *PIPE_JOB, out=tmp_path / "publisher.out")
        try:
            endpoint = wait_for(lambda: read_endpoint(store.path), 60, "the endpoint", pipeline)

            def findings() -> bool:
                body = b"SELECT count() FROM findings WHERE job_id = 'live-job'"
                request = urllib.request.Request(
                    f"http://{endpoint.host}:{endpoint.port}/", data=body)
                try:
                    return int(urllib.request.urlopen(request, timeout=10).read()) > 0
                except (OSError, ValueError):  # tables not created yet
                    return False

            wait_for(findings, 60, "the live job's first finding", pipeline)
            yield store
            # The pipeline went on owning the store the whole time.
            assert pipeline.process.poll() is None, pipeline.err_text()
        finally:
            publisher.kill()
            publisher.wait(timeout=30)
            if pipeline.process.poll() is None:
                pipeline.terminate()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        reason = "Debian's chromium is not installed (infra/setup-test-host.sh installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def app_routes() -> list[str]:
    """Every route of the dashboard app, as path templates; static files by name."""
    from starlette.routing import Mount, Route

    from trainscope.ui.app import HERE, create_app

    paths: list[str] = []
    for route in create_app(None, source="").routes:  # type: ignore[arg-type]
        if isinstance(route, Route):
            paths.append(route.path)
        elif isinstance(route, Mount):
            paths += [f"{route.path}/{f.name}" for f in (HERE / "static").iterdir()]
    return paths


def route_urls(template: str, job: str, functions: list[dict[str, Any]]) -> list[str]:
    """The URLs to ask of one route for one job: its id in the path and in the query, with the
    query parameters each part of the job's API reads."""
    path = template.replace("{job_id:path}", urllib.parse.quote(job, safe=""))
    queries: list[dict[str, Any]] = [{"id": job}]
    if template.endswith("/breakdown"):
        queries = [{"id": job, "rank": 0, "from_ms": 0, "to_ms": 4 * 10**12}]
    if template.endswith("/heatmap"):
        queries += [{"id": job, "layer": f["layer"], "name": f["name"]} for f in functions[:2]]
    return [f"{path}?{urllib.parse.urlencode(q)}" for q in queries]


def check_routes(url: str, jobs: list[str]) -> int:
    """Every route for every job and for an unknown one: no 5xx; every known job's answer is
    200. Returns how many requests were made."""
    asked = 0
    for template in app_routes():
        for job in [*jobs, "no such/job"]:
            functions: list[dict[str, Any]] = []
            if job in jobs:
                status, body = get(f"{url}/api/job/overview?id={urllib.parse.quote(job)}")
                functions = json.loads(body)["functions"]
            for target in route_urls(template, job, functions):
                status, body = get(url + target)
                asked += 1
                # An unknown job is a 404 on the routes of a job, the rest answer 200.
                expected = {200} if job in jobs else {200, 404}
                assert status in expected, (target, status, body[:500])
    return asked


@dataclass
class Crawl:
    pages: list[str] = field(default_factory=list)
    links: set[str] = field(default_factory=set)
    empty: dict[str, set[str]] = field(default_factory=dict)


def visit(browser, url: str, crawl: Crawl) -> list[str]:
    """One page: its errors checked, its sections judged; returns the links on it."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400
            else None)
    response = page.goto(url)
    assert response is not None and response.status == 200, (url, response and response.status)
    if page.locator("#steps").count():
        page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
        job = page.evaluate("window.TRAINSCOPE.job_id")
        assert page.title() == f"{job} · trainscope"  # the link round-tripped, the id is text
        assert page.locator("h1").evaluate("h => h.firstChild.textContent.trim()") == job
        crawl.empty[job] = set(page.evaluate("""(ids) => ids.filter(id => {
            const box = document.getElementById(id);
            return !box.querySelector('.main-svg, table') && !box.innerText.startsWith('Analysed');
        })""", list(SECTIONS)))
        for section in crawl.empty[job]:
            note = page.locator(f"#{section} > p.empty")
            assert note.count() == 1 and note.inner_text().strip(), (url, section)
            assert "undefined" not in note.inner_text(), (url, section, note.inner_text())
        if "whatif" in crawl.empty[job]:  # the command for this job and store
            assert " trainscope whatif " in page.inner_text("#whatif > p.empty"), url
    else:
        assert page.locator("#jobs, #no-jobs").count() == 1, url
        assert page.locator("#dead-letters").inner_text().strip()
    links = page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
    page.close()
    assert errors == [], (url, errors)
    crawl.pages.append(url)
    return links


def crawl_pages(browser, url: str) -> Crawl:
    crawl = Crawl()
    queue, seen = [url + "/"], {url + "/"}
    while queue:
        for link in visit(browser, queue.pop(0), crawl):
            crawl.links.add(link)
            if link.startswith(url + "/") and link not in seen:
                seen.add(link)
                queue.append(link)
    return crawl


PIPELINE_KINDS = {"pipeline-process": "stopped_pipeline_store", "live": "live_store"}


@pytest.mark.parametrize("kind", ["pipeline", "whatif-only", "no-tables", "no-rows",
                                  "dead-letters", "hostile",
                                  *(pytest.param(k, marks=pytest.mark.kafka)
                                    for k in PIPELINE_KINDS)])
def test_every_page_link_and_route_answers(kind: str, request, browser, tmp_path) -> None:
    # The pipeline's kinds are made per test (the live one holds a pipeline running only as
    # long as its crawl); the rest share the module's stores.
    fixture = PIPELINE_KINDS.get(kind)
    store: Store = (request.getfixturevalue(fixture) if fixture
                    else request.getfixturevalue("stores")[kind])
    with serve(store.path, tmp_path / "ui.log") as url:
        status, body = get(url + "/api/jobs")
        assert status == 200, body
        jobs = [j["job_id"] for j in json.loads(body)]
        assert sorted(jobs) == sorted(store.empty), jobs
        asked = check_routes(url, jobs)
        crawl = crawl_pages(browser, url)
        # Every job is reached by following links, and its empty sections are the expected.
        assert crawl.empty == store.empty
        print(f"{kind}: {len(crawl.pages)} pages, {len(crawl.links)} links, {asked} requests")


def test_text_from_producers_never_becomes_markup(stores, browser, tmp_path) -> None:
    """The hostile store's job page with its function picked in the heatmap and its breakdown
    open: every label that names it, Plotly's included, shows the markup as text."""
    with serve(stores["hostile"].path, tmp_path / "ui.log") as url:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/jobs/{urllib.parse.quote(HOSTILE_JOB, safe='')}")
        page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
        assert page.inner_text("h1").startswith(HOSTILE_JOB)
        page.select_option("#metric", f"torch_op/{HOSTILE_FUNCTION}")
        page.wait_for_function("document.getElementById('heatmap').data[0].colorbar.title.text"
                               ".includes('HOSTILE')", timeout=10_000)
        page.evaluate("""() => {
            const gd = document.getElementById('heatmap');
            const xs = gd.data[0].x, t = new Date(xs[Math.floor(xs.length / 2)]).getTime();
            return window.openBreakdown(5, t, t + 15000);
        }""")
        page.wait_for_selector("#breakdown[data-rank='5'] .main-svg", timeout=10_000)
        shown = page.evaluate("""() => [...document.querySelectorAll('*')].filter(e =>
            e.children.length === 0 && e.textContent.includes('HOSTILE')).map(e => [
                e.tagName.toLowerCase(), e.closest('a, b') !== null,
                getComputedStyle(e).fontWeight, e.textContent])""")
        assert errors == []
        page.close()
    labels = [text for _tag, _markup, _weight, text in shown]
    # The job id (title, heading), the function (heatmap scale, breakdown bars, findings) and
    # the finding messages: each shows the markup literally, none became an element.
    assert all(not markup for _tag, markup, _weight, _text in shown), shown
    assert all(int(weight) < 600 for tag, _m, weight, _t in shown if tag in SVG_TEXT), shown
    assert any(tag == "title" and HOSTILE_JOB in text for tag, _m, _w, text in shown), shown
    plotly_labels = [text for tag, _m, _w, text in shown if tag in SVG_TEXT]
    assert any(f"% of time in torch_op/{HOSTILE_FUNCTION}" in t for t in plotly_labels), shown
    assert any(t == f"torch_op/{HOSTILE_FUNCTION}" for t in plotly_labels), shown  # a bar
    assert any("<a href=x>HOSTILE-A</a>" in text for text in labels)


def test_the_whatif_section_blames_a_stage_only_where_there_are_stages(
        stores, browser, tmp_path) -> None:
    """M_S, the share of the last pipeline stage, is the whole job when there is one stage:
    the section says so instead of printing 1.00 as if that stage were to blame."""
    said = {}
    with serve(stores["whatif-only"].path, tmp_path / "ui.log") as url:
        for job in ("wi-job", "wi-one-stage"):
            page = browser.new_page()
            page.goto(f"{url}/jobs/{job}")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            said[job] = page.inner_text("#whatif")
            page.close()
    assert "(last stage)" in said["wi-job"] and "one pipeline stage" not in said["wi-job"]
    assert "M_S: one pipeline stage, no stage to blame" in said["wi-one-stage"]
    assert "(last stage)" not in said["wi-one-stage"]
