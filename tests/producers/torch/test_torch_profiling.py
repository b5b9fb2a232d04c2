"""On-demand profiling: a control message turns torch.profiler on for K steps on one rank."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from torch_producer_helpers import TinyModel, by_type, read_records, steps_of, summaries_of, train

from trainscope.cli.profile import profile, profile_request
from trainscope.producers.torch.control import wait_until
from trainscope.schemas.callpath import callpath_id
from trainscope.schemas.codec import encode_batch
from trainscope.schemas.metrics import PROFILER_BUSY_S
from trainscope.schemas.records import FunctionSummary, MetricSample
from trainscope.transport.bus import CONTROL_TOPIC, rank_key

FINE_LAYERS = {"python", "torch_op", "cuda_kernel", "cuda_api", "memcpy"}


def _request(bus, job: str, rank: int, steps: int) -> str:
    message = profile_request(job, rank, steps)
    bus.publish(CONTROL_TOPIC, encode_batch([message]), key=rank_key(job, rank))
    return message.request_id


def _fine(records: list[object]) -> list[FunctionSummary]:
    return [
        s
        for s in summaries_of(records)
        if s.layer in FINE_LAYERS and s.callpath_id != 0
    ]


def test_a_profile_request_profiles_exactly_k_steps_with_call_paths(attach, memory_bus) -> None:
    att = attach(rank=1, world_size=2)
    model = TinyModel()
    train(model, steps=2)
    assert _fine(read_records(memory_bus, "before")) == []
    request_id = _request(memory_bus, "test-job", rank=1, steps=3)
    assert wait_until(lambda: att.profiler.counts["requested"] == 1, timeout_s=10)
    train(model, steps=6)
    assert wait_until(lambda: bool(att.profiler.reports), timeout_s=30)
    report = att.profiler.reports[0]
    assert report.request_id == request_id
    assert report.steps_profiled == 3 and report.stop_reason == "steps done"
    # The sender's next round reports the session's time to its end (its condensing).
    assert wait_until(lambda: not att.profiler._busy_from_ns, timeout_s=10)
    assert wait_until(lambda: att.stats()["records_queued"] == 0, timeout_s=10)
    att.detach()

    records = read_records(memory_bus)
    # What the session cost the rank is reported (the stream job explains its effect as
    # trainscope's own): from its start to its condensing's end, at least the profiled span.
    busy = [r for r in by_type(records, MetricSample) if r.name == PROFILER_BUSY_S]
    assert busy and all(r.rank == 1 and r.job_id == "test-job" for r in busy), busy
    assert all(report.started_ns <= r.ts_ns for r in busy), busy
    assert sum(r.value for r in busy) >= (report.stopped_ns - report.started_ns) / 1e9 - 0.002
    fine = _fine(records)
    assert fine and all(s.rank == 1 for s in fine)
    layers = {s.layer for s in fine}
    assert {"python", "torch_op"} <= layers
    # Every call path links to its parent: the id is derived from the parent's id.
    table = report.callpaths
    for s in fine:
        parent, layer, name = table[s.callpath_id]
        assert (layer, name) == (s.layer, s.name)
        assert callpath_id(parent, layer, name) == s.callpath_id
        assert parent == 0 or parent in table
    # An ATen op of the model's Linear layers has a Python frame among its ancestors.
    addmm = [s for s in fine if s.name == "aten::addmm"]
    assert addmm
    ancestors = []
    node = table[addmm[0].callpath_id][0]
    while node:
        ancestors.append(table[node])
        node = table[node][0]
    assert any(layer == "python" for _, layer, _ in ancestors)
    assert any("Linear" in name for _, _, name in ancestors)
    # The profile covered 3 steps: 3 forward passes of the top-level module were seen.
    model_calls = [s for s in fine if s.layer == "python" and s.name == "nn.Module: TinyModel_0"]
    assert sum(s.count for s in model_calls) == 3
    # record_function blocks (here the optimizer's own) are annotations, as in a Kineto trace.
    steps = [s for s in summaries_of(records) if s.name == "Optimizer.step#SGD.step"]
    assert {s.layer for s in steps} == {"user_annotation"} and sum(s.count for s in steps) == 3
    # Profiled steps are ordinary steps as well: all 8 still have step records.
    assert len(steps_of(records)) == 8


def test_requests_for_another_rank_or_job_are_ignored(attach, memory_bus) -> None:
    att = attach(rank=0, world_size=2)
    _request(memory_bus, "test-job", rank=1, steps=2)
    _request(memory_bus, "other-job", rank=0, steps=2)
    assert wait_until(lambda: att.stats()["control"].get("ignored", 0) == 2, timeout_s=10)
    train(TinyModel(), steps=4)
    assert att.profiler.counts["started"] == 0
    att.detach()
    assert _fine(read_records(memory_bus)) == []


def test_one_session_at_a_time_and_a_bounded_budget(attach, memory_bus) -> None:
    att = attach(profile_max_steps=2)
    _request(memory_bus, "test-job", rank=0, steps=100)
    assert wait_until(lambda: att.profiler.counts["requested"] == 1, timeout_s=10)
    train(TinyModel(), steps=1)  # the session starts at this step boundary
    assert att.profiler.active
    _request(memory_bus, "test-job", rank=0, steps=1)
    assert wait_until(lambda: att.profiler.counts["requested"] == 2, timeout_s=10)
    assert att.profiler.counts["rejected"] == 1
    train(TinyModel(), steps=4)
    assert wait_until(lambda: bool(att.profiler.reports), timeout_s=30)
    assert att.profiler.reports[0].steps_profiled == 2  # capped by profile_max_steps
    assert att.profiler.counts["started"] == 1


def test_the_profile_command_publishes_a_control_message(monkeypatch) -> None:
    from trainscope.transport.memory import MemoryBus

    bus = MemoryBus()
    monkeypatch.setattr("trainscope.cli.profile.open_bus", lambda url: bus)
    result = CliRunner().invoke(
        profile, ["--job", "J", "--rank", "3", "--steps", "4", "--bus", "memory"]
    )
    assert result.exit_code == 0, result.output
    from trainscope.schemas.codec import decode_batch

    messages = bus.consumer([CONTROL_TOPIC], "check").poll(timeout_s=0.1)
    (message,) = [r for m in messages for r in decode_batch(m.value)]
    assert (message.job_id, message.rank, message.steps, message.action) == ("J", 3, 4, "profile")
    assert message.request_id in result.output


def test_the_profile_command_rejects_bad_input() -> None:
    result = CliRunner().invoke(profile, ["--job", "J", "--rank", "0", "--steps", "0",
                                          "--bus", "memory"])
    assert result.exit_code != 0 and "--steps" in result.output
    with pytest.raises(ValueError):
        profile_request("J", 0, 0)


class BlockModel(TinyModel):
    """Sleeps 5 ms inside a record_function block in every forward."""

    def forward(self, x):
        import time

        from torch.profiler import record_function

        with record_function("extra_block"):
            time.sleep(0.005)
        return super().forward(x)


def test_a_profile_publishes_its_call_path_tree_nested_as_a_trace_would_be(
    attach, memory_bus
) -> None:
    from trainscope.engine.core import ProfileParts
    from trainscope.producers.torch.profiling import call_path_parts
    from trainscope.schemas.records import ProfileCallPaths

    att = attach(rank=1, world_size=2)
    model = BlockModel()
    train(model, steps=1)
    request_id = _request(memory_bus, "test-job", rank=1, steps=3)
    assert wait_until(lambda: att.profiler.counts["requested"] == 1, timeout_s=10)
    train(model, steps=5)
    assert wait_until(lambda: bool(att.profiler.reports), timeout_s=30)
    assert wait_until(lambda: att.stats()["records_queued"] == 0, timeout_s=10)
    report = att.profiler.reports[0]
    att.detach()
    records = read_records(memory_bus)
    (tree,) = by_type(records, ProfileCallPaths)
    assert (tree.rank, tree.request_id, tree.steps) == (1, request_id, 3)
    nodes = dict(zip(tree.callpaths, zip(tree.parents, tree.layers, tree.names, strict=True),
                     strict=True))
    # Every summary's call path is in the tree, with the same counts over the session.
    fine = _fine(records)
    assert {s.callpath_id for s in fine} <= set(nodes)
    counts = dict(zip(tree.callpaths, tree.counts, strict=True))
    for cp in {s.callpath_id for s in fine}:
        assert counts[cp] == sum(s.count for s in fine if s.callpath_id == cp)

    def path(cp: int) -> list[str]:
        names = []
        while cp:
            parent, _, name = nodes[cp]
            names.append(name)
            cp = parent
        return names[::-1]

    # What runs inside the block hangs under it (not beside it, under __enter__), as the
    # trace's calling-context tree has it.
    sleeps = [cp for cp, (_, layer, name) in nodes.items()
              if layer == "python" and name == "<built-in function sleep>"]
    assert sleeps and all(path(cp)[-2] == "extra_block" for cp in sleeps)
    (block,) = [cp for cp, node in nodes.items() if node[1:] == ("user_annotation", "extra_block")]
    total = dict(zip(tree.callpaths, tree.total_ns, strict=True))
    assert 3 * 5_000_000 <= total[block] < 3 * 20_000_000
    # Only the training thread's Python frames: the listener and sender threads only wait.
    assert not [cp for cp in nodes if "threading.py" in path(cp)[0]]
    # Split into parts, the tree comes back whole.
    parts = call_path_parts(report, "test-job", 1, per_part=7)
    assert len(parts) > 1
    assembler = ProfileParts()
    whole = [assembler.add(p) for p in parts][-1]
    assert whole is not None and sorted(c for p in whole for c in p.callpaths) == sorted(nodes)
