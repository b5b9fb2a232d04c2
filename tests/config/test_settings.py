"""One frozen Settings, resolved once when ``trainscope`` starts: store location, ClickHouse server
and credentials, and the window length the producers, the agent and the stream job share."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainscope.config import env
from trainscope.config.settings import Settings, SettingsError


def trainscope(*args: str, env_extra: dict[str, str] | None = None,
               timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINSCOPE_")}
    return subprocess.run(
        [sys.executable, "-m", "trainscope.cli.main", *args], env={**environ, **(env_extra or {})},
        capture_output=True, text=True, timeout=timeout_s, check=False,
    )


def error_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_defaults_and_the_environment(tmp_path: Path) -> None:
    plain = Settings.from_environ({"XDG_DATA_HOME": str(tmp_path)})
    assert plain == Settings(store_dir=tmp_path / "trainscope" / "store")
    assert plain.window_s == 15.0 and plain.clickhouse_url is None
    configured = Settings.from_environ({
        env.TRAINSCOPE_STORE_DIR: str(tmp_path / "s"),
        env.TRAINSCOPE_WINDOW_S: "2.5",
        env.TRAINSCOPE_CLICKHOUSE_URL: "http://ch:8123",
        env.TRAINSCOPE_CLICKHOUSE_USER: "bob",
        env.TRAINSCOPE_CLICKHOUSE_PASSWORD: "hunter2",
    })
    assert (configured.store_dir, configured.store_dir_configured) == (tmp_path / "s", True)
    assert configured.window_s == 2.5
    assert (configured.clickhouse_url, configured.clickhouse_user) == ("http://ch:8123", "bob")
    assert configured.clickhouse_password == "hunter2" and "hunter2" not in repr(configured)
    with pytest.raises(dataclasses.FrozenInstanceError):
        configured.window_s = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("raw", ["soon", "0", "-15", "nan", "0.01"])
def test_an_unusable_window_length_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.from_environ({env.TRAINSCOPE_WINDOW_S: raw})
    assert str(caught.value) == (
        f"TRAINSCOPE_WINDOW_S must be a number of seconds >= 0.1, got {raw!r}"
    )


def test_which_store_a_command_opens(tmp_path: Path) -> None:
    default = Settings(store_dir=tmp_path / "default")
    assert default.store(None, None) == (tmp_path / "default", None)
    assert default.store(None, None, default_dir=False) == (None, None)
    assert default.store(tmp_path / "given", None) == (tmp_path / "given", None)
    server = dataclasses.replace(default, clickhouse_url="http://ch:8123")
    assert server.store(None, None) == (None, "http://ch:8123")
    assert server.store(str(tmp_path / "given"), None) == (tmp_path / "given", None)
    assert server.store(None, "http://other:8123") == (None, "http://other:8123")
    named = dataclasses.replace(default, store_dir_configured=True)
    assert named.store(None, None, default_dir=False) == (tmp_path / "default", None)


def test_a_bad_setting_stops_every_command_with_one_line() -> None:
    line = error_line(trainscope("sql", "SELECT 1", env_extra={env.TRAINSCOPE_WINDOW_S: "soon"}))
    assert line == "Error: TRAINSCOPE_WINDOW_S must be a number of seconds >= 0.1, got 'soon'"


def test_sql_uses_the_store_directory_of_the_environment(tmp_path: Path) -> None:
    store = tmp_path / "from-env"
    done = trainscope("sql", "SELECT count() AS n FROM findings", "--create", "--format", "csv",
                      env_extra={env.TRAINSCOPE_STORE_DIR: str(store)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["n", "0"] and (store / "metadata").is_dir()


def test_sql_uses_the_clickhouse_server_of_the_environment() -> None:
    """No ClickHouse server runs here: the error names the configured address, which shows
    the command went there rather than to the embedded store."""
    from kafka_broker import free_port

    url = f"http://127.0.0.1:{free_port()}"
    done = trainscope("sql", "SELECT 1", env_extra={env.TRAINSCOPE_CLICKHOUSE_URL: url,
                                                   env.TRAINSCOPE_CLICKHOUSE_PASSWORD: "hunter2"})
    assert error_line(done).startswith(f"Error: cannot connect to ClickHouse at {url}")
    assert "hunter2" not in done.stdout + done.stderr


def test_the_stream_job_windows_as_the_environment_tells_the_producers() -> None:
    """The demo's pipeline and its simulated ranks both take TRAINSCOPE_WINDOW_S: a third of
    the window length gives about three times the windows."""
    args = ("demo", "--no-store", "--json", "--steps", "60", "--start-s", "1767225600")
    default = json.loads(trainscope(*args).stdout)
    short = json.loads(trainscope(*args, env_extra={env.TRAINSCOPE_WINDOW_S: "5"}).stdout)
    assert default["events"] == short["events"]
    assert 2.5 * default["windows"] <= short["windows"] <= 3.5 * default["windows"] + 1
