"""Simulated producers as a process of their own: publish a simulated job to a bus.

For tests and benchmarks of the stream job (``trainscope pipeline``) running in another process:

    python -m trainscope.cli.publish_simulated --bus kafka://127.0.0.1:9092 --ranks 64

Each simulated rank sends its spans condensed per window into function summaries, as real
producers do (``--spans``: the raw span events). Prints one JSON object when done: messages
published, span events measured, re-sent copies, and
``last_failed_step``: every step after it was reported delivered by the bus (a publish that
raised or a flush that failed marks its step).
``--resend-every N`` publishes every N-th message twice, byte for byte, as a producer does that
re-sends after a timeout it cannot tell from a loss.
``--clock-skew RANK:SECONDS`` runs a rank on a host whose clock is that far ahead (negative:
behind): every timestamp it sends is off by it. Messages are keyed per host (``job/first rank``)
so a job spreads over partitions; ``--gpus-per-host 1`` keys each rank apart, ``--key-by job``
puts the whole job on one partition.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from trainscope.cli.demo_job import publish_step
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.topics import rank_key
from trainscope.transport.bus import EVENTS_TOPIC, METRICS_TOPIC, Bus, BusError, open_bus


def parse_clock_skew(spec: str) -> tuple[int, float]:
    """``RANK:SECONDS`` as (rank, seconds); ValueError naming the spec otherwise."""
    rank, sep, seconds = spec.partition(":")
    try:
        if not sep:
            raise ValueError
        parsed = int(rank), float(seconds)
    except ValueError:
        raise ValueError(f"--clock-skew {spec!r}: expected RANK:SECONDS, e.g. 3:-30") from None
    if parsed[0] < 0:
        raise ValueError(f"--clock-skew {spec!r}: the rank must be >= 0")
    return parsed


class _Resending:
    """A bus wrapper that publishes every ``every``-th message a second time."""

    def __init__(self, bus: Bus, every: int, job_key: bytes | None = None) -> None:
        self.bus = bus
        self.every = every
        self.job_key = job_key  # every message under this key: the job on one partition
        self.messages = 0
        self.resent = 0
        self.refused = 0  # publish raised: the bus was down or its outbox full

    def publish(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        self.messages += 1
        key = self.job_key or key
        try:
            self.bus.publish(topic, value, key)
            if self.every and self.messages % self.every == 0:
                self.bus.publish(topic, value, key)
                self.resent += 1
        except BusError:
            self.refused += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        self.bus.flush(timeout_s)

    def consumer(self, topics: list[str], group: str):  # pragma: no cover - not used
        return self.bus.consumer(topics, group)

    def close(self) -> None:
        self.bus.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bus", required=True)
    parser.add_argument("--job-id", default="sim-job")
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-s", type=int, default=1767225600)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--steps-per-s", type=float, default=0.0,
                        help="Pace the job (0: as fast as possible).")
    parser.add_argument("--window-s", type=float, default=15.0,
                        help="The stream job's window: each rank condenses its spans over it.")
    parser.add_argument("--spans", action="store_true",
                        help="Send raw span events instead of per-window function summaries.")
    parser.add_argument("--resend-every", type=int, default=0)
    parser.add_argument("--flush-every", type=int, default=10,
                        help="Wait for delivery every this many steps.")
    parser.add_argument("--clock-skew", action="append", default=[], metavar="RANK:SECONDS",
                        help="Run RANK on a clock SECONDS ahead (negative: behind); repeatable.")
    parser.add_argument("--gpus-per-host", type=int, default=8,
                        help="Ranks per host; messages are keyed per host (1: per rank).")
    parser.add_argument("--key-by", choices=("host", "job"), default="host",
                        help="Key messages per host (default) or put the whole job under one "
                             "key, hence on one partition.")
    args = parser.parse_args(argv)
    try:
        skews = tuple(parse_clock_skew(s) for s in args.clock_skew)
    except ValueError as exc:
        parser.error(str(exc))

    spec = ClusterSpec(job_id=args.job_id, dp=args.dp, pp=args.pp, tp=args.tp,
                       steps=args.steps, seed=args.seed, start_ns=args.start_s * 10**9,
                       window_s=args.window_s, send="spans" if args.spans else "summaries",
                       gpus_per_host=args.gpus_per_host, clock_skew_s=skews)
    cluster = SimulatedCluster(spec, parse_faults(args.fault))
    raw = open_bus(args.bus)
    connect = getattr(raw, "connect", None)
    if connect is not None:
        connect([EVENTS_TOPIC, METRICS_TOPIC])
    bus = _Resending(raw, args.resend_every,
                     rank_key(args.job_id, 0) if args.key_by == "job" else None)
    events = failed_flushes = 0
    last_failed_step = -1  # every step after it was reported delivered
    started = time.monotonic()
    try:
        for output in cluster.run():
            refused = bus.refused
            publish_step(bus, cluster, output, output.step == 0)  # type: ignore[arg-type]
            events += output.span_count
            if bus.refused != refused:
                last_failed_step = output.step
            if args.flush_every and (output.step + 1) % args.flush_every == 0:
                try:
                    bus.flush()
                except BusError as exc:  # reported in the summary, as a producer would count
                    failed_flushes += 1
                    last_failed_step = output.step
                    print(f"flush failed at step {output.step}: {exc}", file=sys.stderr)
            if args.steps_per_s > 0:
                wait = started + (output.step + 1) / args.steps_per_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
        try:
            bus.flush()
        except BusError as exc:
            failed_flushes += 1
            last_failed_step = spec.steps - 1
            print(f"final flush failed: {exc}", file=sys.stderr)
    finally:
        counts = dict(getattr(raw, "counts", {}))
        raw.close()
    print(json.dumps({"messages": bus.messages, "resent": bus.resent, "events": events,
                      "refused": bus.refused, "failed_flushes": failed_flushes,
                      "last_failed_step": last_failed_step, "bus": counts,
                      "elapsed_s": round(time.monotonic() - started, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
