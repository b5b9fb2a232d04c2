"""Fuzzing the real pipeline: 100,000 generated messages, no crash, every bad one dead-lettered,
and a valid job interleaved with them gets exactly the findings it gets alone.

Messages come from a seeded numpy generator (fast enough to make 100k in a few seconds; a
failure reproduces from the seed): random bytes, truncated and bit-flipped valid batches, and
valid batches with one field swapped for a boundary value (huge/negative ranks, 0/negative/huge
timestamps, NaN/inf, empty/huge strings, wrong types, inconsistent columns). Mutations of the
valid job's own messages always use a value that must be rejected, so its data is only ever
added to or left alone; bit flips and edge values that may still be valid are applied to the
messages of other jobs only.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import pytest

from trainscope.cli.demo_job import publish_step
from trainscope.detectors.mixture import MixtureDetector
from trainscope.detectors.multivariate import RankAnomalyDetector
from trainscope.detectors.peer import PeerDiffDetector
from trainscope.detectors.steptime import StepTimeDetector
from trainscope.engine.bus_job import BusStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults
from trainscope.schemas.records import Finding
from trainscope.schemas.untrusted import BoundedPayload
from trainscope.sinks.clickhouse import ClickHouseSink, run_query
from trainscope.transport.bus import DEAD_LETTER_TOPIC, EVENTS_TOPIC, METRICS_TOPIC, Bus
from trainscope.transport.memory import MemoryBus

SEED = 13
VALID_JOB = "job-alpha"
WINDOW_S = 5.0
TEN_DAYS_NS = 10 * 86_400 * 10**9
# The jobs send raw span batches (the path Kineto replay uses): the mutator knows span columns
# (INVALID_COLUMN), not yet the columns of summary batches.
SEND: Literal["spans"] = "spans"
HUGE = "x" * 5000  # longer than any text limit

# Values that make any record holding the field invalid, whatever topology is known.
INVALID: dict[str, list[object]] = {
    "v": [0, -1, 99, "1", None],
    "job_id": ["", HUGE, 7, None],
    "host": [HUGE, 7, None],
    "rank": [-2, 2**17, 2**20, 2**27, 2**31 - 1, 2**40, 2**63 - 1, 2**64 - 1, -(2**63), "3", 1.5,
             None],
    "step": [-1, 2**31, -(2**63), "s"],
    "start_ns": [0, -1, 1, 2**63 - 1, 2**64 - 1, 946_684_799 * 10**9, "t", 1.5e18, None],
    "duration_ns": [-1, -(2**63), 2**63 - 1, 8 * 86_400 * 10**9, "d"],
    "samples": [-1, 2**64 - 1, "n"],
    "tokens": [-1, 2**64 - 1, [1]],
    "seq_len_mean": [math.nan, math.inf, -1.0, "x"],
    "seq_len_max": [-1, 2**64 - 1],
    "collective_ns": [-1, 2**64 - 1, "c"],
    "device_collective_ns": [-1, -(2**63), 2**64 - 1, 1.5],
    "device": [-2, 2**20, "d"],
    "name": ["", HUGE, 7, None],
    "value": [math.nan, math.inf, -math.inf, "x", None],
    "dp_size": [0, -1, 2**40, "2"],
    "pp_size": [0, 2**40, None],
    "tp_size": [-5, 2**62],
    "cp_size": [0, 1.5],
    "workers": ["w", [{"rank": 10**6}], [{"rank": -1}], [{"rank": 0, "dp_rank": 99}]],
    "layers": ["abc", None, [5]],
    "names": ["abc", None, [HUGE]],
}
# Per span column: element values that are invalid wherever they appear.
INVALID_COLUMN: dict[str, tuple[str, list[int]]] = {
    "rank": ("<i4", [-1, 2**17, 2**20, 2**31 - 1, -(2**31)]),
    "fn": ("<i4", [-1, 2**31 - 1]),
    "step": ("<i4", [-2, -(2**31)]),
    "start_ns": ("<i8", [0, -1, 2**63 - 1, -(2**63), 946_684_799 * 10**9]),
    "duration_ns": ("<i8", [-1, 2**62, -(2**63)]),
    "bytes_moved": ("<i8", [-1, -(2**63)]),
}
# Values at and just inside the limits: for other jobs' messages, which may stay valid.
EDGE: dict[str, list[object]] = {
    "rank": [0, 1, 2, 7, 8, 131_071, -1],
    "start_ns": [946_684_800 * 10**9, 1_767_225_600 * 10**9 + 10**15],
    "duration_ns": [0, 7 * 86_400 * 10**9],
    "value": [0.0, -1e308, 1e308, 5e-324],
    "name": ["a", "n" * 256],
    "step": [0, 2**31 - 1],
}


@dataclass
class Generated:
    payloads: list[bytes]
    must_reject: list[bool]
    kinds: list[str]


def job_payloads(spec: ClusterSpec, faults: list[str]) -> list[bytes]:
    """The job's messages in publish order, as the demo's producers send them."""
    bus = MemoryBus(partitions=1)
    consumer = bus.consumer([EVENTS_TOPIC, METRICS_TOPIC], "collect")
    cluster = SimulatedCluster(spec, parse_faults(faults))
    payloads: list[bytes] = []
    for output in cluster.run():
        publish_step(bus, cluster, output, output.step == 0)
        payloads += [m.value for m in consumer.poll(max_records=10**6, timeout_s=0)]
    return payloads


def valid_job() -> list[bytes]:
    spec = ClusterSpec(job_id=VALID_JOB, dp=4, pp=2, tp=1, steps=90, seed=7, window_s=WINDOW_S,
                       send=SEND)
    return job_payloads(spec, ["gc-pause:rank=3,ms=300,every=5"])


def noise_jobs() -> list[bytes]:
    out: list[bytes] = []
    for i, fault in enumerate(["slow-gpu:rank=1,factor=1.5", "dataloader-stall:rank=0,ms=200",
                               "gc-pause:rank=1,ms=300,every=3"]):
        spec = ClusterSpec(job_id=f"zz-noise-{i}", dp=2, pp=1, tp=1, steps=40, seed=i,
                           microbatches=2, window_s=WINDOW_S, send=SEND)
        out += job_payloads(spec, [fault])
    return out


class Mutator:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def pick(self, values: list) -> object:
        return values[int(self.rng.integers(len(values)))]

    def random_bytes(self) -> bytes:
        return self.rng.bytes(int(self.rng.integers(0, 200)))

    def truncate(self, payload: bytes) -> bytes:
        return payload[: int(self.rng.integers(0, len(payload)))]

    def flip_bits(self, payload: bytes) -> bytes:
        raw = bytearray(payload)
        for _ in range(int(self.rng.integers(1, 4))):
            bit = int(self.rng.integers(len(raw) * 8))
            raw[bit // 8] ^= 1 << (bit % 8)
        return bytes(raw)

    def substitute(self, payload: bytes, *, invalid: bool) -> bytes:
        """One field of one record set to a boundary value (always an invalid one if asked)."""
        doc = msgspec.msgpack.decode(payload)
        record = self.pick(doc["records"])
        fields = [f for f in record if f in INVALID or f in INVALID_COLUMN]
        if not invalid and self.rng.random() < 0.5:
            fields = [f for f in fields if f in EDGE] or fields
        name = str(self.pick(fields))
        if record["type"] == "spans" and name in INVALID_COLUMN:
            record[name] = self.column(record, name, invalid=invalid)
        elif not invalid and name in EDGE and self.rng.random() < 0.5:
            record[name] = self.pick(EDGE[name])
        else:
            record[name] = self.pick(INVALID[name])
        return msgspec.msgpack.encode(doc)

    def column(self, record: dict, name: str, *, invalid: bool) -> bytes:
        raw = record[name]
        dtype, bad = INVALID_COLUMN[name]
        width = np.dtype(dtype).itemsize
        if not raw or self.rng.random() < 0.2:
            return raw[:-1] if raw else b"\x00" * (width + 1)  # inconsistent column length
        values = np.frombuffer(raw, dtype=dtype).copy()
        i = int(self.rng.integers(len(values)))
        if invalid or self.rng.random() < 0.5:
            values[i] = self.pick(bad)
        else:
            values[i] += int(self.rng.integers(-3, 4))
        return values.tobytes()


def generate(count: int, seed: int = SEED) -> tuple[list[bytes], Generated]:
    """The valid job's messages, and ``count`` others to interleave with them."""
    rng = np.random.default_rng(seed)
    mutate = Mutator(rng)
    valid, noise = valid_job(), noise_jobs()
    out = Generated([], [], [])
    # (kind, share of messages, must be rejected)
    plan = [("random-bytes", 0.33, True), ("truncated", 0.14, True), ("bit-flip", 0.22, False),
            ("boundary-invalid", 0.16, True), ("boundary-edge", 0.10, False),
            ("valid-job-invalid", 0.03, True), ("other-job-valid", 0.02, False)]
    kinds = rng.choice(len(plan), size=count, p=[share for _, share, _ in plan])
    for k in kinds:
        kind, _, must_reject = plan[k]
        source = noise[int(rng.integers(len(noise)))]
        if kind == "random-bytes":
            payload = mutate.random_bytes()
        elif kind == "truncated":
            payload = mutate.truncate(source)
        elif kind == "bit-flip":
            payload = mutate.flip_bits(source)
        elif kind == "boundary-invalid":
            payload = mutate.substitute(source, invalid=True)
        elif kind == "boundary-edge":
            payload = mutate.substitute(source, invalid=False)
        elif kind == "valid-job-invalid":
            own = valid[int(rng.integers(len(valid)))]
            if rng.random() < 0.25:
                payload = mutate.truncate(own)
            else:
                payload = mutate.substitute(own, invalid=True)
        else:
            payload = source
        out.payloads.append(payload)
        out.must_reject.append(must_reject)
        out.kinds.append(kind)
    return valid, out


def interleave(valid: list[bytes], noise: Generated, rng: np.random.Generator
               ) -> tuple[list[bytes], list[bool]]:
    """All messages in one order; the valid job's keep theirs. Returns payloads and a mask of
    the ones that must be rejected."""
    slots = np.sort(rng.integers(0, len(valid) + 1, len(noise.payloads)))
    payloads: list[bytes] = []
    must: list[bool] = []
    j = 0
    for i, own in enumerate([*valid, None]):
        while j < len(slots) and slots[j] <= i:
            payloads.append(noise.payloads[j])
            must.append(noise.must_reject[j])
            j += 1
        if own is not None:
            payloads.append(own)
            must.append(False)
    return payloads, must


def detectors() -> list:
    return [PeerDiffDetector(), StepTimeDetector(), RankAnomalyDetector(), MixtureDetector()]


def consume(bus: Bus, topic: str, **kwargs: object) -> BusStreamJob:
    pipeline = BusStreamJob(bus, group=f"fuzz-{uuid.uuid4().hex[:8]}", topics=(topic,),
                        detectors=detectors(), window_s=WINDOW_S, **kwargs)
    pipeline.run(idle_timeout_s=0.0 if isinstance(bus, MemoryBus) else 5.0)
    pipeline.finish()
    return pipeline


def keys(findings: list[Finding]) -> set[tuple[int, str, str, int]]:
    return {(f.rank, f.category, f.function, f.window_start_ns)
            for f in findings if f.job_id == VALID_JOB}


def alone(valid: list[bytes]) -> set[tuple[int, str, str, int]]:
    bus = MemoryBus(partitions=1)
    for payload in valid:
        bus.publish(EVENTS_TOPIC, payload)
    found = keys(consume(bus, EVENTS_TOPIC).findings)
    assert any(category == "python-gc" for _, category, _, _ in found), found
    return found


REASON = re.compile(r"^(?P<topic>[\w.-]+)\[(?P<partition>\d+)\]@(?P<offset>\d+): \S.*$")


@pytest.mark.slow
def test_100k_fuzzed_messages_never_crash_and_never_perturb_a_valid_job(tmp_path) -> None:
    started = time.perf_counter()
    valid, noise = generate(100_000)
    payloads, must_reject = interleave(valid, noise, np.random.default_rng(SEED + 1))
    generated_s = time.perf_counter() - started
    expected = keys_alone = alone(valid)

    bus = MemoryBus(partitions=1)
    for payload in payloads:
        bus.publish(EVENTS_TOPIC, payload)
    sink = ClickHouseSink.open(tmp_path / "store")
    try:
        pipeline = consume(bus, EVENTS_TOPIC, sink=sink)
        rows = run_query(sink.client, "SELECT offset, error FROM dead_letters")[1]
    finally:
        sink.close()
    elapsed_s = time.perf_counter() - started

    stats = pipeline.stats()
    assert stats.decode.received == len(payloads) >= 100_000
    assert (stats.decode.emitted + stats.decode.rejected + stats.decode.dropped
            == stats.decode.received)  # dropped: valid copies of a batch already taken
    assert stats.validate.emitted + stats.validate.rejected == stats.validate.received
    # Every rejected message is in the table and on the topic, once, with a reason.
    assert len(rows) == stats.decode.rejected == bus.message_count(DEAD_LETTER_TOPIC)
    reasons = {}
    for offset, error in rows:
        match = REASON.match(error)
        assert match, error
        assert (match["topic"], int(match["offset"])) == (EVENTS_TOPIC, offset)
        reasons[offset] = error
    assert len(reasons) == len(rows)
    bad = {offset for offset, must in enumerate(must_reject) if must}
    assert bad <= set(reasons), f"{len(bad - set(reasons))} bad messages were accepted"
    assert sum(must_reject) > 60_000
    # The valid job's findings, to the window: exactly as alone.
    assert keys(pipeline.findings) == expected, (keys_alone ^ keys(pipeline.findings))
    print(f"\nfuzz: {len(payloads):,} messages ({generated_s:.1f} s to generate), "
          f"{len(rows):,} dead letters, {stats.decode.emitted:,} accepted, "
          f"{stats.jobs_evicted} jobs evicted, {len(expected)} findings of the valid job kept; "
          f"{elapsed_s:.1f} s in all")


@pytest.mark.kafka
@pytest.mark.slow
def test_fuzzed_messages_over_kafka_are_dead_lettered_on_the_topic(kafka_broker, tmp_path
                                                                   ) -> None:
    from trainscope.transport.kafka import KafkaBus

    valid, noise = generate(2_000, seed=SEED + 2)
    payloads, must_reject = interleave(valid, noise, np.random.default_rng(SEED + 3))
    topic = f"fuzz-{uuid.uuid4().hex[:8]}"
    bus = KafkaBus(kafka_broker.bootstrap_servers)
    try:
        bus.connect([topic, DEAD_LETTER_TOPIC])
        for payload in payloads:
            bus.publish(topic, payload)  # keyless: spread over the partitions
        bus.flush()
        sink = ClickHouseSink.open(tmp_path / "store")
        try:
            pipeline = consume(bus, topic, sink=sink)
            rows = run_query(sink.client, "SELECT error, payload FROM dead_letters")[1]
            described = run_query(sink.client, "SELECT error, payload, payload_bytes, "
                                  "payload_sha256 FROM dead_letters")[1]
        finally:
            sink.close()
        letters = _dead_letters_of(bus, topic, len(rows))
    finally:
        bus.close()

    stats = pipeline.stats()
    assert stats.decode.received == len(payloads)
    assert len(rows) == stats.decode.rejected == len(letters)
    assert all(REASON.match(error) and error.startswith(f"{topic}[") for error, _ in rows)
    # The topic's key is the reason cut to 200 bytes, then the payload's size and digest.
    keys_and_values = set()
    for error, payload, size_bytes, sha256 in described:
        prefix = bytes.fromhex(payload)
        description = BoundedPayload(prefix, int(size_bytes), sha256).describe()
        keys_and_values.add((error.encode()[:200] + f" | {description}".encode(), prefix))
    assert keys_and_values == letters
    rejected_payloads = {bytes.fromhex(payload) for _, payload in rows}
    for payload, must in zip(payloads, must_reject, strict=True):
        if must:
            assert payload in rejected_payloads
    # Over several partitions the valid job is still windowed whole and still diagnosed.
    assert any(category == "python-gc" and rank == 3
               for rank, category, _, _ in keys(pipeline.findings))


def _dead_letters_of(bus: Bus, topic: str, expected: int) -> set[tuple[bytes, bytes]]:
    """Dead letters this test's topic produced (the topic is shared by the session)."""
    consumer = bus.consumer([DEAD_LETTER_TOPIC], f"fuzz-check-{uuid.uuid4().hex[:8]}")
    found: set[tuple[bytes, bytes]] = set()
    deadline = time.monotonic() + 60
    try:
        while len(found) < expected and time.monotonic() < deadline:
            for message in consumer.poll(max_records=10_000, timeout_s=1.0):
                if (message.key or b"").startswith(f"{topic}[".encode()):
                    found.add((message.key or b"", message.value))
    finally:
        consumer.close()
    return found
