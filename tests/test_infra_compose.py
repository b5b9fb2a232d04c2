"""infra/compose.yml: the services an operator gets, and commands this code accepts.

No container runtime runs in CI, so the file is checked where it can break without one: every
service the scale-out deployment needs is there, the images are built from files in this
repository, and each trainscope and Flink job command line parses with the current CLI (an
option renamed in the code fails here, not in an operator's `docker compose up`).
"""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

from trainscope.cli.main import cli as trainscope_cli
from trainscope.engines.flink import job as flink_job

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "infra" / "compose.yml"


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def parse_cli(args: list[str]) -> click.Context:
    """Resolve ``trainscope ARGS`` down to its command and parse its options, without running it."""
    command: click.Command = trainscope_cli
    ctx = click.Context(command, info_name="trainscope")
    rest = list(args)
    while isinstance(command, click.Group):
        assert rest and not rest[0].startswith("-"), f"no command named in {args}"
        name = rest.pop(0)
        sub = command.get_command(ctx, name)
        assert sub is not None, f"no command {name!r} in {args}"
        command = sub
        ctx = click.Context(command, info_name=name, parent=ctx)
    return command.make_context(ctx.info_name, rest, parent=ctx.parent)


def test_the_deployment_has_kafka_clickhouse_flink_and_two_faust_workers(services: dict) -> None:
    assert {"kafka", "clickhouse", "flink", "faust-1", "faust-2"} <= set(services)
    for name in ("faust-1", "faust-2"):
        ctx = parse_cli(services[name]["command"])
        assert ctx.command.name == "faust"
        # The detection tier reads what Flink writes, not the raw events a second time.
        assert ctx.params["input_kind"] == "summaries"
        assert ctx.params["bus_url"] == "kafka://kafka:9092"
    # One Faust app: the two workers share the work instead of doing it twice.
    app_ids = {parse_cli(services[n]["command"]).params["app_id"] for n in ("faust-1", "faust-2")}
    assert len(app_ids) == 1
    env = services["faust-1"]["environment"]
    assert env["TRAINSCOPE_CLICKHOUSE_URL"].startswith("http://clickhouse:")


def test_the_flink_service_runs_the_job_module_with_arguments_it_accepts(services: dict) -> None:
    dockerfile = (REPO / services["flink"]["build"]["dockerfile"]).read_text()
    assert "trainscope.engines.flink.job" in dockerfile
    assert "openjdk-17-jre-headless" in dockerfile
    args = flink_job.parse_args(["--jars", "/opt/flink-venv/jars", *services["flink"]["command"]])
    assert args.bootstrap_servers == "kafka:9092"
    faust_window = parse_cli(services["faust-1"]["command"]).params["window_s"]
    window_s = faust_window or float(services["faust-1"]["environment"]["TRAINSCOPE_WINDOW_S"])
    assert args.window_s == window_s  # both tiers cut the same windows


def test_images_are_built_from_this_repository(services: dict) -> None:
    for name in ("flink", "faust-1", "faust-2"):
        build = services[name]["build"]
        dockerfile = (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile.is_file(), dockerfile
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                for source in line.split()[1:-1]:
                    assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}"
