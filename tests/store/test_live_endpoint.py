"""The owner of an embedded store serves reads: ``trainscope pipeline`` as its own process, over
the real broker, writes a store while other processes query it through its read endpoint.

One pipeline (and one paced publisher whose event time follows the wall clock) serves the whole
module: every way to write or escape is refused while its row counts keep growing, ``trainscope
sql --store`` and clickhouse-connect read it live, and its endpoint file goes away when it
stops. Tokens and stale endpoint files use a small owner process of their own.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import lz4.frame
import pytest
from kafka_broker import TansuBroker
from pipeline_procs import PipelineProcess, start_publisher

from trainscope.config import env
from trainscope.store.live import ENDPOINT_FILE, Endpoint, read_endpoint

WINDOW_S = 2.0
LATENESS_S = 0.5
SIM_STEP_S = 0.77  # event time of one simulated step (ClusterSpec defaults): paced to wall time


def trainscope(*args: str, env_extra: dict[str, str] | None = None,
               timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**os.environ, **(env_extra or {})})


def wait_for(condition, timeout_s: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@dataclass
class Answer:
    status: int
    body: str
    headers: dict[str, str]


def request(ep: Endpoint, target: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> Answer:
    """One raw HTTP request: the target goes on the wire exactly as given."""
    conn = http.client.HTTPConnection(ep.host, ep.port, timeout=30)
    try:
        conn.request("POST" if body is not None else "GET", target, body=body,
                     headers=headers or {})
        reply = conn.getresponse()
        return Answer(reply.status, reply.read().decode(errors="replace"), dict(reply.headers))
    finally:
        conn.close()


def select(ep: Endpoint, sql: str) -> str:
    answer = request(ep, "/", body=sql.encode())
    assert answer.status == 200, answer.body
    return answer.body


@dataclass
class Live:
    """The running pipeline, its store and endpoint, and the publisher's start."""

    pipeline: PipelineProcess
    store: Path
    endpoint: Endpoint
    published_from_s: float


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    store = tmp / "store"
    with TansuBroker() as broker:
        pipeline = PipelineProcess(
            broker.url, store, "live-reads", "--window-s", str(WINDOW_S), "--lateness-s",
            str(LATENESS_S), "--commit-interval-s", "0.5", "--close-idle-s", "5",
            "--source-idle-s", "1", logs=tmp / "pipeline")
        started = time.time()
        publisher = start_publisher(
            broker.url, "--job-id", "live", "--dp", "2", "--pp", "2", "--tp", "2", "--steps",
            "400", "--window-s", str(WINDOW_S), "--start-s", str(int(started)),
            "--steps-per-s", str(round(1 / SIM_STEP_S, 3)), "--flush-every", "1",
            out=tmp / "publisher.out")
        try:
            ep = wait_for(lambda: read_endpoint(store), 60, "the pipeline's endpoint file")
            wait_for(lambda: int(select(ep, "SELECT count() FROM function_summaries")) > 0, 60,
                     "the first window in the store")
            yield Live(pipeline, store, ep, started)
        finally:
            publisher.kill()
            publisher.wait(timeout=30)
            if pipeline.process.poll() is None:
                pipeline.terminate()


def rows(ep: Endpoint) -> int:
    return int(select(ep, "SELECT count() FROM function_summaries"))


def _lz4_frames(text: str) -> bytes:
    half = len(text) // 2
    return lz4.frame.compress(text[:half].encode()) + lz4.frame.compress(text[half:].encode())


# (case, request target, body, extra headers, a fragment the refusal names)
Q = "/?query="
ATTACKS: list[tuple[str, str, bytes | None, dict[str, str], str]] = [
    ("insert", "/", b"INSERT INTO findings SELECT * FROM findings", {}, "'INSERT' statements"),
    ("insert lower case", "/", b"insert into findings select * from findings", {},
     "'INSERT' statements"),
    ("alter delete", "/", b"ALTER TABLE findings DELETE WHERE 1", {}, "'ALTER'"),
    ("delete", "/", b"DELETE FROM findings WHERE 1", {}, "'DELETE'"),
    ("update", "/", b"UPDATE findings SET score = 0 WHERE 1", {}, "'UPDATE'"),
    ("optimize", "/", b"OPTIMIZE TABLE function_summaries FINAL", {}, "'OPTIMIZE'"),
    ("truncate", "/", b"TRUNCATE TABLE findings", {}, "'TRUNCATE'"),
    ("create", "/", b"CREATE TABLE x (a Int8) ENGINE = Memory", {}, "'CREATE'"),
    ("drop", "/", b"DROP TABLE findings", {}, "'DROP'"),
    ("rename", "/", b"RENAME TABLE findings TO f2", {}, "'RENAME'"),
    ("attach", "/", b"ATTACH TABLE x", {}, "'ATTACH'"),
    ("detach", "/", b"DETACH TABLE findings", {}, "'DETACH'"),
    ("set", "/", b"SET readonly = 0", {}, "'SET'"),
    ("settings clause", "/", b"SELECT 1 SETTINGS readonly = 0", {}, "SETTINGS clause"),
    ("settings clause, file template", "/",
     b"SELECT 1 FORMAT Template SETTINGS format_template_resultset = '/etc/passwd'", {},
     "SETTINGS clause"),
    ("setting in the URL", "/?readonly=0", b"SELECT 1", {}, "URL parameter 'readonly'"),
    ("time limit in the URL", "/?max_execution_time=100000", b"SELECT 1", {},
     "URL parameter 'max_execution_time'"),
    ("result limit in the URL", Q + "SELECT%201&max_result_rows=0", None, {},
     "URL parameter 'max_result_rows'"),
    ("file setting in the URL", "/?format_template_resultset=%2Fetc%2Fpasswd", b"SELECT 1", {},
     "URL parameter"),
    ("system", "/", b"SYSTEM SHUTDOWN", {}, "'SYSTEM'"),
    ("kill", "/", b"KILL QUERY WHERE 1", {}, "'KILL'"),
    ("grant", "/", b"GRANT ALL ON *.* TO default", {}, "'GRANT'"),
    ("use", "/", b"USE system", {}, "'USE'"),
    ("backup", "/", b"BACKUP TABLE findings TO File('b.zip')", {}, "'BACKUP'"),
    ("multi-statement", "/", b"SELECT 1; DROP TABLE findings", {}, "multiple statements"),
    ("multi-statement, two reads", "/", b"SELECT 1;SELECT 2", {}, "multiple statements"),
    ("into outfile", "/", b"SELECT 1 INTO OUTFILE '/tmp/trainscope-live-out'", {}, "OUTFILE"),
    ("insert into function file", "/", b"INSERT INTO FUNCTION file('/tmp/x') SELECT 1", {},
     "'INSERT'"),
    ("from infile", "/", b"SELECT * FROM findings FROM INFILE '/etc/passwd'", {}, "INFILE"),
    ("file()", "/", b"SELECT * FROM file('/etc/passwd', 'LineAsString')", {}, "file()"),
    ("file() scalar", "/", b"SELECT file('/etc/passwd')", {}, "file()"),
    ("url()", "/", b"SELECT * FROM url('http://127.0.0.1:1/', 'CSV', 'a String')", {},
     "url()"),
    ("s3()", "/", b"SELECT * FROM s3('http://127.0.0.1:1/b/k.csv', 'CSV')", {}, "s3()"),
    ("hdfs()", "/", b"SELECT * FROM hdfs('hdfs://h:9000/f', 'CSV', 'a String')", {},
     "hdfs()"),
    ("remote()", "/", b"SELECT * FROM remote('127.0.0.1:9000', system.one)", {}, "remote()"),
    ("remoteSecure()", "/", b"SELECT * FROM remoteSecure('h:9440', system.one)", {},
     "remoteSecure()"),
    ("cluster()", "/", b"SELECT * FROM cluster('default', system.one)", {}, "cluster()"),
    ("mysql()", "/", b"SELECT * FROM mysql('h:3306', 'd', 't', 'u', 'p')", {}, "mysql()"),
    ("postgresql()", "/", b"SELECT * FROM postgresql('h:5432', 'd', 't', 'u', 'p')", {},
     "postgresql()"),
    ("jdbc()", "/", b"SELECT * FROM jdbc('jdbc:x', 't')", {}, "jdbc()"),
    ("odbc()", "/", b"SELECT * FROM odbc('DSN=x', 't')", {}, "odbc()"),
    ("input()", "/", b"SELECT * FROM input('a String')", {}, "input()"),
    ("executable()", "/", b"SELECT * FROM executable('cat', 'CSV', 'a String')", {},
     "executable()"),
    ("iceberg()", "/", b"SELECT * FROM icebergS3('http://h/t')", {}, "icebergS3()"),
    ("odd case FiLe()", "/", b"SELECT * FROM FiLe('/etc/passwd', 'LineAsString')", {},
     "FiLe()"),
    ("quoted `file`()", "/", b"SELECT * FROM `file`('/etc/passwd', 'LineAsString')", {},
     "file()"),
    ("comment between name and (", "/", b"SELECT * FROM file/**/('/etc/passwd', 'CSV')", {},
     "file()"),
    ("file() inside a subquery", "/",
     b"SELECT 1 WHERE 1 IN (SELECT 1 FROM url('http://127.0.0.1:1/', 'CSV', 'a UInt8'))", {},
     "url()"),
    ("file() after UNION", "/",
     b"SELECT 'a' UNION ALL SELECT * FROM file('/etc/passwd', 'LineAsString')", {}, "file()"),
    ("comment inside DROP TABLE", "/", b"DROP/**/TABLE findings", {}, "'DROP'"),
    ("comment hiding a statement", "/", b"/* SELECT */ DROP TABLE findings", {}, "'DROP'"),
    ("block comment then ;", "/", b"SELECT 1 /* x */; DROP TABLE findings", {},
     "multiple statements"),
    ("line comment then ;", "/", b"SELECT 1 -- x\n; DROP TABLE findings", {},
     "multiple statements"),
    ("hash comment then ;", "/", b"SELECT 1 # x\n; DROP TABLE findings", {},
     "multiple statements"),
    ("nested comment", "/", b"SELECT 1 /* /* */ ; DROP TABLE findings */", {}, "nested"),
    ("string then ;", "/", b"SELECT 'a\\\\'; DROP TABLE findings", {}, "multiple statements"),
    ("heredoc then ;", "/", b"SELECT $x$a$x$; DROP TABLE findings", {}, "multiple statements"),
    ("parenthesised then ;", "/", b"(SELECT 1); DROP TABLE findings", {},
     "multiple statements"),
    ("unterminated string", "/", b"SELECT 'a; DROP TABLE findings", {}, "unterminated"),
    ("whitespace and tabs", "/", b"\n\t  DROP\tTABLE\r\nfindings", {}, "'DROP'"),
    ("odd case dRoP", "/", b"dRoP TaBlE findings", {}, "'DROP'"),
    ("WITH … INSERT", "/", b"WITH 1 AS x INSERT INTO findings SELECT * FROM findings", {},
     "INSERT"),
    ("EXPLAIN of a write", "/", b"EXPLAIN SYNTAX DROP TABLE findings", {}, "DROP"),
    ("URL-encoded DROP in the URL", Q + "%44ROP%20TABLE%20findings", None, {}, "'DROP'"),
    ("double URL-encoded", Q + "%2544ROP%2520TABLE%2520findings", None, {},
     "malformed number"),
    ("URL-encoded ; in the URL", Q + "SELECT%201%3B%20DROP%20TABLE%20findings", None, {},
     "multiple statements"),
    ("query twice in the URL", Q + "SELECT%201&query=DROP%20TABLE%20findings", None, {},
     "twice"),
    ("URL query + body", Q + "SELECT%201", b"; DROP TABLE findings", {},
     "multiple statements"),
    ("form-encoded body", "/", b"query=DROP+TABLE+findings",
     {"Content-Type": "application/x-www-form-urlencoded"}, "statements"),
    ("multipart body", "/", b"--b\r\n\r\nDROP TABLE findings\r\n--b--",
     {"Content-Type": "multipart/form-data; boundary=b"}, "multipart"),
    ("fullwidth DROP", "/", "ＤＲＯＰ TABLE findings".encode(), {}, "U+FF24"),
    ("homoglyph fіle()", "/", "SELECT * FROM fіle('/etc/passwd', 'CSV')".encode(), {},
     "U+0456"),
    ("no-break space", "/", "SELECT\u00a01; DROP TABLE findings".encode(), {}, "U+00A0"),
    ("NUL byte", "/", b"SELECT 1\x00; DROP TABLE findings", {}, "U+0000"),
    ("not UTF-8", "/", b"SELECT '\xff'; DROP TABLE findings", {}, "not UTF-8"),
    ("backslash outside quotes", "/", b"SELECT 1 \\; DROP TABLE findings", {}, "'\\\\'"),
    ("LZ4 frames hiding DROP", "/", _lz4_frames("DROP TABLE findings"),
     {"Content-Encoding": "lz4"}, "'DROP'"),
    ("gzip hiding ;", "/", gzip.compress(b"SELECT 1; DROP TABLE findings"),
     {"Content-Encoding": "gzip"}, "multiple statements"),
    ("unknown Content-Encoding", "/", b"SELECT 1", {"Content-Encoding": "br2"},
     "Content-Encoding"),
    ("catboostEvaluate()", "/", b"SELECT catboostEvaluate('/etc/passwd', 1)", {},
     "catboostEvaluate()"),
    ("compressed response asked", Q + "SELECT%201&compress=1", None, {}, "'compress'"),
]


@pytest.mark.kafka
@pytest.mark.slow
def test_every_way_to_write_or_escape_is_refused_while_the_pipeline_writes(live: Live) -> None:
    ep = live.endpoint
    tables = select(ep, "SELECT name FROM system.tables WHERE database = currentDatabase() "
                        "ORDER BY name")
    before = rows(ep)
    names = [case for case, *_ in ATTACKS]
    assert len(set(names)) == len(names) >= 40
    wrong = []
    for case, target, body, headers, reason in ATTACKS:
        answer = request(ep, target, body, headers)
        line = answer.body.strip()
        if not (answer.status == 403 and line.startswith("Code: 164. DB::Exception: trainscope "
                                                          "read endpoint: ")
                and reason in line and line.endswith("(READONLY)") and "\n" not in line
                and answer.headers.get("X-ClickHouse-Exception-Code") == "164"):
            wrong.append(f"{case}: {answer.status} {line[:300]}")
    assert not wrong, "\n".join(wrong)
    # Nothing happened to the store, and the pipeline went on writing meanwhile.
    assert select(ep, "SELECT name FROM system.tables WHERE database = currentDatabase() "
                      "ORDER BY name") == tables
    assert not Path("/tmp/trainscope-live-out").exists()
    wait_for(lambda: rows(ep) > before, 30, "the pipeline to write more rows")
    assert live.pipeline.process.poll() is None
    # And the engine runs the queries with readonly=1 and the limits too (defence in depth).
    assert select(ep, "SELECT getSetting('readonly'), getSetting('max_execution_time') > 0, "
                      "getSetting('max_result_rows') > 0").split() == ["1", "1", "1"]


@pytest.mark.kafka
@pytest.mark.slow
def test_reads_that_look_like_writes_are_served(live: Live) -> None:
    ep = live.endpoint
    assert select(ep, "SELECT 'DROP TABLE findings; INSERT' AS `update`").strip() == (
        "DROP TABLE findings; INSERT")
    assert "function_summaries" in select(ep, "SHOW TABLES")
    assert "CREATE TABLE" in select(ep, "SHOW CREATE TABLE findings")
    assert "window_start_ns" in select(ep, "DESCRIBE TABLE function_summaries")
    assert select(ep, "EXISTS TABLE findings").strip() == "1"
    assert select(ep, "WITH 2 AS x SELECT x * {y:UInt8}".replace("{y:UInt8}", "3")).strip() == "6"
    assert request(ep, "/?query=SELECT%20%7Bn%3AUInt8%7D%20%2B%201&param_n=41").body == "42\n"
    assert select(ep, "SELECT count() FROM system.settings WHERE name = 'readonly'").strip() == "1"
    answer = request(ep, "/", b"SELECT count() FROM numbers(10) FORMAT JSONEachRow")
    assert answer.headers["X-ClickHouse-Format"] == "JSONEachRow"
    assert json.loads(answer.body) in ({"count()": "10"}, {"count()": 10})
    assert request(ep, "/ping").body == "Ok.\n"


NEWEST = "SELECT max(window_start_ns) FROM function_summaries WHERE job_id = 'live'"


def watch_windows(ep: Endpoint, stop: threading.Event, seen: dict[int, float]) -> None:
    """When each window first shows in the store (wall clock), polled every 50 ms."""
    while not stop.is_set():
        newest = int(select(ep, NEWEST))
        seen.setdefault(newest, time.time())
        stop.wait(0.05)


@pytest.mark.kafka
@pytest.mark.slow
def test_trainscope_sql_reads_the_live_store_up_to_the_last_window(live: Live) -> None:
    ep = live.endpoint
    seen: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_windows, args=(ep, stop, seen), daemon=True)
    watcher.start()
    try:
        # Past the start-up backlog, to windows written at the job's pace.
        wait_for(lambda: len(seen) >= 6, 40, "five more windows")
        asked = time.time()
        done = trainscope("sql", "SELECT count() AS n, max(window_start_ns) AS newest FROM "
                          "function_summaries WHERE job_id = 'live'", "--store", str(live.store),
                          "--format", "json")
        answered = time.time()
    finally:
        stop.set()
        watcher.join(timeout=10)
    assert done.returncode == 0, done.stderr
    [row] = [json.loads(line) for line in done.stdout.splitlines()]
    newest = int(row["newest"])
    assert row["n"] > 0
    # The answer holds the newest window the store had when the query was asked (or a newer
    # one), and that window was written less than one window before the query was asked.
    latest_before = max(w for w, t in seen.items() if t <= asked)
    assert newest >= latest_before
    age_s = asked - seen[newest] if newest in seen else 0.0
    gaps = sorted(seen.values())
    print(f"trainscope sql took {answered - asked:.2f} s; its newest window was written "
          f"{age_s:.2f} s before it was asked; windows were written every "
          f"{[round(b - a, 2) for a, b in itertools.pairwise(gaps)]} s; event time of the newest "
          f"window's end was {answered - newest / 1e9 - WINDOW_S:.2f} s behind the wall clock")
    assert age_s < WINDOW_S + 1.0, age_s
    # Event time follows the wall clock (the publisher is paced), so the store is behind it by
    # the window, the lateness, the publisher's start-up and the query's own run.
    assert answered - newest / 1e9 - WINDOW_S < 2 * WINDOW_S + LATENESS_S + 5.0
    assert live.pipeline.process.poll() is None
    # Latency of a small query through the endpoint, with the pipeline writing.
    started = time.perf_counter()
    for _ in range(20):
        select(ep, "SELECT count() FROM findings")
    print(f"query latency on the live store: {(time.perf_counter() - started) / 20 * 1e3:.1f} ms")


@pytest.mark.kafka
@pytest.mark.slow
def test_clickhouse_connect_works_against_the_endpoint(live: Live) -> None:
    import clickhouse_connect

    ep = live.endpoint
    for compress in (False, True):  # True: LZ4 request bodies in several frames
        client = clickhouse_connect.get_client(host=ep.host, port=ep.port, compress=compress)
        result = client.query("SELECT job_id, count() AS n FROM function_summaries "
                               "WHERE job_id = {job:String} GROUP BY job_id",
                               parameters={"job": "live"})
        assert result.result_rows[0][0] == "live" and result.result_rows[0][1] > 0
        frame = client.query_df("SELECT rank, window_start FROM function_summaries LIMIT 5")
        assert list(frame.columns) == ["rank", "window_start"] and len(frame) == 5
        with pytest.raises(Exception, match="READONLY"):
            client.command("DROP TABLE findings")
        client.close()


OWNER = r"""
import sys, time
from trainscope.sinks.clickhouse import ClickHouseSink
sink = ClickHouseSink.open(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()
sink.close()
"""


@pytest.fixture
def owner(tmp_path: Path) -> Iterator:
    """Starts a small owner process of a fresh store (a sink, as the pipeline opens it)."""
    procs: list[subprocess.Popen[str]] = []

    def start(extra_env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "store")],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, **(extra_env or {})})
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_token_is_required_when_configured(owner, tmp_path: Path) -> None:
    store = tmp_path / "store"
    owner({env.TRAINSCOPE_STORE_READ_TOKEN: "s3cret"})
    ep = read_endpoint(store)
    assert ep is not None and ep.token_required and ep.host == "127.0.0.1"
    assert "s3cret" not in (store / ENDPOINT_FILE).read_text()
    for headers in ({}, {"X-ClickHouse-Key": "wrong"}):
        answer = request(ep, "/?query=SELECT%201", headers=headers)
        assert answer.status == 403 and "(AUTHENTICATION_FAILED)" in answer.body
    basic = base64.b64encode(b"default:s3cret").decode()
    for headers, target in (({"X-ClickHouse-Key": "s3cret"}, "/?query=SELECT%201"),
                            ({"Authorization": f"Basic {basic}"}, "/?query=SELECT%201"),
                            ({}, "/?query=SELECT%201&user=default&password=s3cret")):
        assert request(ep, target, headers=headers).body == "1\n"
    query = ("SELECT count() AS n FROM findings", "--store", str(store), "--format", "csv")
    line = trainscope("sql", *query).stderr.strip()
    assert line.endswith(f"requires a token: set {env.TRAINSCOPE_STORE_READ_TOKEN}"), line
    done = trainscope("sql", *query, env_extra={env.TRAINSCOPE_STORE_READ_TOKEN: "s3cret"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["n", "0"]


def test_the_endpoint_file_goes_at_exit_and_a_stale_one_is_ignored(owner, tmp_path: Path) -> None:
    store = tmp_path / "store"
    proc = owner()
    assert (store / ENDPOINT_FILE).exists()
    proc.communicate("\n", timeout=60)  # a clean exit
    assert proc.returncode == 0
    assert not (store / ENDPOINT_FILE).exists()

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = {"host": "127.0.0.1", "port": 9, "pid": dead.pid, "token_required": False}
    (store / ENDPOINT_FILE).write_text(json.dumps(stale))
    assert read_endpoint(store) is None
    # Nobody owns the store: the stale file is ignored and the store opens directly.
    done = trainscope("sql", "SELECT count() AS n FROM findings", "--store", str(store),
                      "--format", "csv")
    assert done.returncode == 0, done.stderr
    # An owner that serves no endpoint, beside a stale file: the old refusal, saying what to do.
    proc = owner({env.TRAINSCOPE_STORE_READ_BIND: "off"})
    (store / ENDPOINT_FILE).write_text(json.dumps(stale))
    line = trainscope("sql", "SELECT 1", "--store", str(store)).stderr.strip()
    assert line.startswith(f"Error: store {store.resolve()} is in use by process {proc.pid} ("
                           ), line  # its command line's start: not a trainscope command
    assert "), which serves no read endpoint" in line, line
    assert "TRAINSCOPE_STORE_READ_BIND=off" in line


@pytest.mark.kafka
@pytest.mark.slow
def test_zz_the_pipeline_removes_its_endpoint_file_when_it_stops(live: Live) -> None:
    assert (live.store / ENDPOINT_FILE).exists()
    assert live.pipeline.terminate() == 0, live.pipeline.err_text()
    assert not (live.store / ENDPOINT_FILE).exists()
    done = trainscope("sql", "SELECT count() > 0 AS written FROM function_summaries", "--store",
                      str(live.store), "--format", "csv")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["written", "1"]
