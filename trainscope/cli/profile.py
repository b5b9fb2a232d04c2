"""``trainscope profile``: ask one rank of a running job to profile itself for a few steps."""

from __future__ import annotations

import time
import uuid

import click

from trainscope.config import env
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.records import ControlMessage
from trainscope.transport.bus import CONTROL_TOPIC, BusError, open_bus, rank_key


def profile_request(job_id: str, rank: int, steps: int, request_id: str = "") -> ControlMessage:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return ControlMessage(
        job_id=job_id,
        action="profile",
        rank=rank,
        steps=steps,
        request_id=request_id or uuid.uuid4().hex,
        issued_ns=time.time_ns(),
    )


@click.command("profile")
@click.option("--job", "job_id", required=True, help="Job id as the training processes report it.")
@click.option("--rank", type=int, required=True, help="Global rank to profile (-1: every rank).")
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="Training steps to profile.")
@click.option("--bus", "bus_url", envvar=env.TRAINSCOPE_BUS, required=True,
              help=f"Bus URL (kafka://HOST:PORT); default from ${env.TRAINSCOPE_BUS}.")
def profile(job_id: str, rank: int, steps: int, bus_url: str) -> None:
    """Turn on torch.profiler on one rank of a running job for a few steps.

    The rank summarises what it saw per function (Python frames, torch ops, CUDA kernels,
    memory copies, with call paths) and sends only the summaries.
    """
    message = profile_request(job_id, rank, steps)
    try:
        bus = open_bus(bus_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--bus") from None
    try:
        bus.publish(CONTROL_TOPIC, encode_batch([message]), key=rank_key(job_id, rank))
        bus.flush(timeout_s=15.0)
    except BusError as exc:
        raise click.ClickException(f"could not send the request to {bus_url}: {exc}") from None
    finally:
        bus.close()
    click.echo(
        f"requested profiling of job {job_id} rank {rank} for {steps} steps "
        f"(request {message.request_id})"
    )
