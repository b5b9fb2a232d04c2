"""Every SQL in the Grafana dashboard runs on a store that a demo job with a slow GPU filled.

Grafana's macros and the dashboard's variables are replaced as the ClickHouse data source
plugin does (``$__fromTime_ms`` becomes a ``DateTime64(3)``), so a panel whose SQL no longer
fits the tables fails here rather than on a user's screen. The queries run read-only in a child
process (chDB lets one process own a store).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "dashboards"
START_S = 1_767_225_600
CULPRIT = 5

RUN = r"""
import json, sys
from trainscope.store.client import connect
client = connect(sys.argv[1], readonly=True, create=False)
out = {}
for name, sql in json.loads(sys.stdin.read()).items():
    result = client.query(sql)
    out[name] = [dict(zip(result.column_names, map(str, row))) for row in result.result_rows]
print(json.dumps(out))
"""


def expand(sql: str, job: str, function: str) -> str:
    """As Grafana and the plugin would, for the hour around the demo job (at a 15 s
    interval)."""
    from_ms, to_ms = (START_S - 3600) * 1000, (START_S + 3600) * 1000
    sql = re.sub(r"\$__timeFilter_ms\((\w+)\)", lambda m: (
        f"{m[1]} >= fromUnixTimestamp64Milli({from_ms}) AND "
        f"{m[1]} <= fromUnixTimestamp64Milli({to_ms})"), sql)
    sql = re.sub(r"\$__timeInterval\((\w+)\)",
                 lambda m: f"toStartOfInterval(toDateTime({m[1]}), INTERVAL 15 second)", sql)
    for macro, ms in (("$__fromTime_ms", from_ms), ("$__toTime_ms", to_ms)):
        sql = sql.replace(macro, f"fromUnixTimestamp64Milli(toInt64({ms}))")
    sql = sql.replace("${job}", job).replace("$job", job)
    sql = sql.replace("${function}", function).replace("$function", function)
    assert "$" not in sql, f"unexpanded macro or variable in: {sql}"
    return sql


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grafana")
    path = root / "store"
    for args in (
        ("demo", "--ranks", "16", "--dp", "4", "--pp", "2", "--tp", "2", "--steps", "80",
         "--fault", f"slow-gpu:rank={CULPRIT},factor=1.4", "--start-s", str(START_S),
         "--store", str(path), "--optrace", str(root / "ops")),
        ("whatif", "--trace", str(root / "ops" / "optrace.parquet"), "--meta",
         str(root / "ops" / "optrace.yaml"), "--job", "demo-job", "--store", str(path)),
    ):
        done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", *args],
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr
    return path


def test_every_panel_and_variable_query_runs_and_shows_the_culprit(store: Path) -> None:
    [path] = sorted(DASHBOARD.glob("*.json"))
    dashboard = json.loads(path.read_text())
    queries: dict[str, str] = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queries[panel["title"]] = expand(target["rawSql"], "demo-job", "torch_op/backward")
    for variable in dashboard["templating"]["list"]:
        queries["variable " + variable["name"]] = expand(variable["query"], "demo-job", "")
    done = subprocess.run([sys.executable, "-c", RUN, str(store)], input=json.dumps(queries),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert all(results[name] for name in queries), {k: len(v) for k, v in results.items()}

    by_title = {re.sub(r" \(.*", "", name): rows for name, rows in results.items()}
    assert [r["job_id"] for r in by_title["Jobs"]] == ["demo-job"]
    assert by_title["variable function"][0]["f"] == "torch_op/backward"
    heat = by_title["Rank × time: share of step time in $function"]
    hottest = max(heat, key=lambda r: float(r["share"]))
    assert hottest["rank"] == str(CULPRIT)
    findings = by_title["Findings at or above 0.5"]
    assert (findings[0]["rank"], findings[0]["category"]) == (str(CULPRIT), "gpu-compute")
    assert float(by_title["Latest what-if"][0]["slowdown_S"]) > 1.05
    assert len(by_title["Step time"]) >= 5
