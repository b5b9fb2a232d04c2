"""The differential calling-context tree finds the extra ``record_function`` block that one
rank of a real gloo job ran, and its cost within 1% of what the job measured itself (between
the block's own work and the whole block round it, see ``trace_jobs``)."""

from __future__ import annotations

import json
from pathlib import Path

from trace_data import H100_TRACES
from trace_jobs import assert_block_time

from trainscope.schemas.callpath import callpath_id
from trainscope.traces.cct import PathTimes, path_of
from trainscope.traces.condense import condense
from trainscope.traces.diff import diff, hot_chain, suspect_score, waiting_excess
from trainscope.traces.reader import read_trace, trace_files


def _trees(directory: Path) -> dict[int, object]:
    out = {}
    for path in trace_files([directory]):
        trace = read_trace(path)
        out[trace.rank] = condense(trace, "j", 10**9).whole()
    return out


def _check_names_the_extra_block(chain, known: dict) -> None:
    names = [name for _, name in chain[-1].path]
    assert "extra_work" in names, [d.label() for d in chain]
    (block,) = [d for d in chain if d.path[-1][1] == "extra_work"]
    assert_block_time(block.delta_total_ns, known)
    assert block.path[-2][1] == "ProfilerStep#*"


def test_suspect_rank_against_its_peer(gloo_traces: Path) -> None:
    known = json.loads((gloo_traces / "extra_ns.txt").read_text())
    trees = _trees(gloo_traces)
    suspect = trees.pop(known["rank"])
    deltas = diff(suspect, list(trees.values()))
    chain = hot_chain(deltas)
    _check_names_the_extra_block(chain, known)
    # Per step, against the peer, on every step: three steps of 50 ms each.
    assert chain[-1].per_step and chain[-1].steps == 3
    # The peer against the suspect finds no excess under extra_work (it never ran it).
    back = diff(next(iter(trees.values())), [suspect])
    assert not [d for d in back.values() if "extra_work" in d.label() and d.delta_ns > 0]


def test_the_rank_that_waits_is_not_taken_for_the_cause(gloo_traces: Path) -> None:
    """Rank 0 waits for rank 1 in the all-reduce: its gloo:all_reduce and, around it, its
    backward take longer than rank 1's. The cause's score is its own-work excess less its
    excess in collectives, so rank 1 scores high and rank 0 low."""
    known = json.loads((gloo_traces / "extra_ns.txt").read_text())
    trees = _trees(gloo_traces)
    cause, victim = trees[known["rank"]], trees[1 - known["rank"]]
    to_victim, to_cause = diff(victim, [cause]), diff(cause, [victim])
    assert waiting_excess(to_victim) > 0 > waiting_excess(to_cause)
    assert suspect_score(to_cause) > known["ns"] / 3 > suspect_score(to_victim)
    # The victim's hot chain never ends in a collective.
    assert all(layer != "collective" for d in hot_chain(to_victim) for layer, _ in d.path)


def test_two_runs_merged_over_ranks(gloo_traces: Path) -> None:
    """Run B (both ranks, merged) against run A (rank 0 only, as a run without the block)."""
    known = json.loads((gloo_traces / "extra_ns.txt").read_text())
    trees = _trees(gloo_traces)
    run_b = trees[0].merged(trees[1])
    assert run_b.steps == 6
    run_a = trees[0]
    chain = hot_chain(diff(run_b, [run_a]))
    # Merged per step over 6 rank-steps: the block's 3 steps show as half of it per step.
    (block,) = [d for d in chain if d.path[-1][1] == "extra_work"]
    assert_block_time(block.delta_ns * 6, known)


def test_a_trace_against_itself_has_no_hot_chain() -> None:
    trace = read_trace(H100_TRACES[0], rank=0)
    times = condense(trace, "j", 10**9).whole()
    assert hot_chain(diff(times, [times])) == []
    # Kernels sit under the op that launched them in the H100 trace.
    kernels = [cp for cp, (_, layer, _) in times.nodes.items() if layer == "cuda_kernel"]
    assert kernels
    for cp in kernels:
        layers = [layer for layer, _ in path_of(times.nodes, cp)]
        assert layers[-2:] == ["cuda_api", "cuda_kernel"] and "torch_op" in layers


def _times(paths: dict[tuple[tuple[str, str], ...], int], steps: int = 5) -> PathTimes:
    """A tree from {path of (layer, name): total ns}."""
    times = PathTimes({}, {}, {}, {}, steps)
    for path, total in paths.items():
        parent = 0
        for layer, name in path:
            cp = callpath_id(parent, layer, name)
            times.nodes.setdefault(cp, (parent, layer, name))
            parent = cp
        times.count[parent], times.total_ns[parent], times.self_ns[parent] = steps, total, 0
    return times


def test_waiting_in_a_blocking_collective_call_is_not_the_frame_above_it() -> None:
    """The suspect ran 30 ms/step of extra work and, while its peer's profile stopped, waited
    45 ms/step in a ``dist.broadcast`` (a Python frame of torch.distributed, its wait a
    Python built-in): the chain names the work, and the broadcast's wait is not counted in
    the excess of the frames that called it."""
    MS = 1_000_000
    module = ("python", "train.py(60): <module>")
    fwd = (module, ("python", "train.py(34): forward"))
    extra = (*fwd, ("user_annotation", "extra_work"))
    call = (module, ("python", "torch/distributed/c10d_logger.py(80): wrapper"))
    bcast = (*call, ("python", "torch/distributed/distributed_c10d.py(3085): broadcast"))
    wait = (*bcast, ("python", "<built-in method wait of PyCapsule>"))
    suspect = _times({(module,): 105 * MS * 5, fwd: 40 * MS * 5, extra: 30 * MS * 5,
                      call: 55 * MS * 5, bcast: 55 * MS * 5, wait: 55 * MS * 5})
    peer = _times({(module,): 30 * MS * 5, fwd: 10 * MS * 5, call: 10 * MS * 5,
                   bcast: 10 * MS * 5, wait: 10 * MS * 5})
    chain = hot_chain(diff(suspect, [peer]))
    assert chain[-1].path == extra, [d.label() for d in chain]
    assert [round(d.delta_ns / MS) for d in chain] == [30, 30, 30]


def test_a_collective_call_only_the_suspect_made_is_waiting_not_its_work() -> None:
    """In its 5 profiled steps the suspect made a ``dist`` call its peer did not (seen as
    torch's ``c10d_logger`` decorator under the producer's own timing wrapper, named by its
    full path, with no frame of ``distributed_c10d`` under it): that is waiting, so the chain
    names its extra forward work instead (fault matrix (f))."""
    MS = 1_000_000
    module = ("python", "train.py(77): <module>")
    fwd = (module, ("python", "train.py(34): forward"))
    ours = (module, ("python", "/opt/venv/lib/trainscope/producers/torch/collectives.py(116): "
                               "wrapper"))
    logger = (*ours, ("python", "torch/distributed/c10d_logger.py(80): wrapper"))
    suspect = _times({(module,): 57 * MS * 5, fwd: 44 * MS * 5, ours: 8 * MS * 5,
                      logger: 8 * MS * 5})
    peer = _times({(module,): 45 * MS * 5, fwd: 40 * MS * 5})
    chain = hot_chain(diff(suspect, [peer]))
    assert chain[-1].path == fwd, [d.label() for d in chain]
    assert [round(d.delta_ns / MS) for d in chain] == [4, 4]


def test_a_block_that_holds_most_of_the_excess_ends_the_chain_on_a_busy_host() -> None:
    """The figures of a CI run on a loaded 2-core host: the suspect's loop took +49 ms/step
    over its peer's, +31 ms of it in its ``extra_work`` block and the rest lost to the
    scheduler all over the loop (a few ms in each of data loading, backward, the optimizer
    and the loop itself). The block holds most of the excess, so the chain ends there, not at
    the loop."""
    MS = 1_000_000
    loop = (("python", "loop_jobs.py(68): run_rank"),)
    fwd = (*loop, ("python", "loop_jobs.py(34): forward"))
    extra = (*fwd, ("user_annotation", "extra_work"))
    data = (*loop, ("python", "torch/utils/data/dataloader.py(720): __next__"))
    backward = (*loop, ("python", "torch/_tensor.py(566): backward"))
    optim = (*loop, ("python", "torch/optim/optimizer.py(509): wrapper"))
    suspect = _times({loop: 60 * MS * 5, fwd: 32 * MS * 5, extra: 31 * MS * 5,
                      data: 6 * MS * 5, backward: 12 * MS * 5, optim: 4 * MS * 5})
    peer = _times({loop: 11 * MS * 5, fwd: 1 * MS * 5, data: 1 * MS * 5,
                   backward: 7 * MS * 5, optim: 1 * MS * 5})
    chain = hot_chain(diff(suspect, [peer]))
    assert chain[-1].path == extra, [d.label() for d in chain]
    assert [round(d.delta_ns / MS) for d in chain] == [49, 31, 31]


def test_two_blocks_with_equal_shares_end_the_chain_above_them() -> None:
    """Neither of two equally slow blocks explains the excess more than the other: the chain
    names the frame that holds both."""
    MS = 1_000_000
    loop = (("python", "train.py(68): train"),)
    fwd = (*loop, ("python", "train.py(34): forward"))
    first = (*fwd, ("user_annotation", "tokenise"))
    second = (*fwd, ("user_annotation", "augment"))
    suspect = _times({loop: 50 * MS * 5, fwd: 40 * MS * 5, first: 20 * MS * 5,
                      second: 20 * MS * 5})
    peer = _times({loop: 10 * MS * 5, fwd: 0 * MS * 5, first: 0, second: 0})
    chain = hot_chain(diff(suspect, [peer]))
    assert chain[-1].path == fwd, [d.label() for d in chain]
