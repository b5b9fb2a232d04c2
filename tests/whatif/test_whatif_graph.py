"""The dependency model built from one step's times: streams, matching, groups, chains."""

import numpy as np
import pytest

from trainscope.schemas import optypes as ot
from trainscope.schemas.optrace import TraceError
from trainscope.whatif.analysis import layout_graph
from trainscope.whatif.generate import JobSpec
from trainscope.whatif.graph import Template, build_graph


def template(*per_stage, data_parallel=True):
    """A template from per-stage lists of (optype, start, end); returns it and a name → node
    lookup where names are "optype#seq@stage"."""
    flat = [(s, *op) for s, ops in enumerate(per_stage) for op in ops]
    op = np.array([ot.CODE[f[1]] for f in flat])
    stage = np.array([f[0] for f in flat])
    seq = np.zeros(len(flat), dtype=int)
    seen: dict = {}
    names = {}
    for i, (s, code) in enumerate(zip(stage, op, strict=True)):
        seq[i] = seen.get((s, code), 0)
        seen[(s, code)] = seq[i] + 1
        names[f"{ot.OPTYPES[code]}#{seq[i]}@{s}"] = i
    t = Template(
        stage=stage,
        op=op,
        seq=seq,
        mc=np.zeros(len(flat), dtype=int),
        start_s=np.array([f[2] for f in flat], dtype=float),
        end_s=np.array([f[3] for f in flat], dtype=float),
        pp_size=len(per_stage),
        data_parallel=data_parallel,
    )
    return t, names


# Two stages, two micro-batches (1F1B): stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1.
# "send forward, recv backward" and "send backward, recv forward" are batched: same start/end.
TWO_STAGES = (
    [
        ("params-all-gather", 0, 1),
        ("backward-send", 0.5, 0.6),  # never launched: ends before any backward compute
        ("forward-compute", 2, 3),
        ("forward-send", 3, 4),
        ("forward-compute", 4, 5),
        ("forward-send", 5, 8),
        ("backward-recv", 5, 8),
        ("backward-compute", 8, 10),
        ("backward-recv", 10, 12),
        ("backward-compute", 12, 14),
        ("gc", 14, 14),
        ("layernorm-grads-all-reduce", 14, 15),
        ("embedding-grads-all-reduce", 15, 16),
        ("grads-reduce-scatter", 16, 17),
        ("optimizer-clip-main-grad", 17, 18),
        ("optimizer", 18, 19),
    ],
    [
        ("params-all-gather", 0, 1),
        ("forward-recv", 1, 4),
        ("forward-compute", 4, 5),
        ("backward-compute", 5, 7),
        ("backward-send", 7, 8),
        ("forward-recv", 7, 8),
        ("forward-compute", 8, 9),
        ("backward-compute", 9, 11),
        ("backward-send", 11, 12),
        ("backward-recv", 13, 13.1),  # never launched: after the last backward compute
        ("gc", 11, 11),
        ("layernorm-grads-all-reduce", 12, 13),
        ("embedding-grads-all-reduce", 13, 16),
        ("grads-reduce-scatter", 16, 17),
        ("optimizer-clip-main-grad", 17, 18),
        ("optimizer", 18, 19),
    ],
)


def test_streams_matching_and_groups():
    t, n = template(*TWO_STAGES)
    g = build_graph(t)

    def deps(name):
        return {k for k, v in n.items() if v in g.deps[n[name]]}

    def peers(name):
        return {k for k, v in n.items() if v in g.peers[n[name]]}

    # Compute chain, and the compute a recv feeds waits for it.
    assert deps("backward-compute#1@0") == {"backward-compute#0@0", "backward-recv#1@0"}
    # First forward compute of the chunk waits for its params all-gather.
    assert deps("forward-compute#0@0") == {"params-all-gather#0@0"}
    assert deps("forward-compute#0@1") == {"params-all-gather#0@1", "forward-recv#0@1"}
    # A send follows its compute and the previous send of its stream; the batched recv sits on
    # its own stream, after the compute before the one it feeds.
    assert deps("forward-send#1@0") == {"forward-compute#1@0", "forward-send#0@0"}
    assert deps("forward-recv#1@1") == {"forward-recv#0@1", "backward-compute#0@1"}
    # First backward recv: after the second-to-last forward compute before the first backward.
    assert deps("backward-recv#0@0") == {"forward-compute#0@0"}
    # Send/recv pairs between neighbouring stages, by order of the launched ops.
    assert peers("forward-send#0@0") == {"forward-recv#0@1"}
    assert peers("forward-recv#1@1") == {"forward-send#1@0"}
    assert peers("backward-send#0@1") == {"backward-recv#0@0"}
    assert peers("backward-recv#1@0") == {"backward-send#1@1"}
    # Never-launched ops: flagged, alone, and they do not shift the pairing.
    assert g.noop[n["backward-send#0@0"]] and g.noop[n["backward-recv#0@1"]]
    assert g.noop.sum() == 2
    assert peers("backward-send#0@0") == set() and peers("backward-recv#0@1") == set()
    # After the last compute: gc → layernorm → embedding → reduce-scatter → clip → optimizer.
    assert deps("gc#0@1") == {"backward-compute#1@1"}
    assert deps("layernorm-grads-all-reduce#0@1") == {"gc#0@1"}
    assert deps("grads-reduce-scatter#0@1") == {
        "embedding-grads-all-reduce#0@1",
        "params-all-gather#0@1",
    }
    assert deps("optimizer#0@0") == {"optimizer-clip-main-grad#0@0"}
    # Embedding all-reduce joins first and last stage; clip joins all stages and DP ranks.
    assert peers("embedding-grads-all-reduce#0@0") == {"embedding-grads-all-reduce#0@1"}
    assert peers("optimizer-clip-main-grad#0@1") == {"optimizer-clip-main-grad#0@0"}
    wide = {k for k, v in n.items() if g.dp_wide[v]}
    assert wide == {
        f"{name}#0@{s}"
        for name in ("params-all-gather", "grads-reduce-scatter", "optimizer-clip-main-grad")
        for s in (0, 1)
    }
    assert sorted(g.order) == list(range(2 * len(n)))
    assert list(g.final_nodes) == [n["optimizer#0@0"], n["optimizer#0@1"]]


def test_overlapped_grad_sync_and_no_data_parallelism():
    stage = [
        ("params-all-gather", 0, 1),
        ("forward-compute", 1, 2),
        ("backward-compute", 2, 3),
        ("grads-reduce-scatter", 3, 4),
        ("layernorm-grads-all-reduce", 4, 5),
        ("separate-grads-all-reduce", 5, 6),
        ("optimizer-clip-main-grad", 6, 7),
        ("optimizer", 7, 8),
    ]
    t, n = template(stage)
    g = build_graph(t)
    assert set(g.deps[n["grads-reduce-scatter#0@0"]]) == {
        n["backward-compute#0@0"],
        n["params-all-gather#0@0"],
    }
    assert set(g.deps[n["separate-grads-all-reduce#0@0"]]) == {
        n["layernorm-grads-all-reduce#0@0"],
        n["grads-reduce-scatter#0@0"],
    }
    # Without data parallelism no compute waits for a data-parallel op.
    t, n = template(stage, data_parallel=False)
    g = build_graph(t)
    assert g.deps[n["forward-compute#0@0"]] == ()
    assert set(g.deps[n["optimizer-clip-main-grad#0@0"]]) == {n["layernorm-grads-all-reduce#0@0"]}


def test_equal_starts_give_the_same_graph_in_any_row_order():
    t, _n = template(*TWO_STAGES)
    g = build_graph(t)
    perm = np.random.default_rng(3).permutation(len(t.op))
    shuffled = Template(
        t.stage[perm], t.op[perm], t.seq[perm], t.mc[perm], t.start_s[perm], t.end_s[perm], 2
    )
    h = build_graph(shuffled)
    back = np.argsort(perm)  # node i of t is node back[i] of shuffled

    def edges(graph, relabel):
        return {
            (kind, relabel[a], relabel[b])
            for kind, lists in (("dep", graph.deps), ("peer", graph.peers))
            for a, xs in enumerate(lists)
            for b in xs
        }

    assert edges(g, np.arange(len(perm))) == edges(h, perm)
    assert (h.noop[back] == g.noop).all()


def test_cycle_is_detected_and_named():
    # Stage 0 receives the backward before its forward compute: a deadlock.
    with pytest.raises(TraceError, match=r"cycle through: .*on stage"):
        build_graph(
            template(
                [
                    ("backward-recv", 0, 1),
                    ("backward-compute", 1, 2),
                    ("forward-compute", 2, 3),
                    ("forward-send", 3, 4),
                    ("optimizer", 4, 5),
                ],
                [
                    ("forward-recv", 0, 1),
                    ("forward-compute", 1, 2),
                    ("backward-compute", 2, 3),
                    ("backward-send", 3, 4),
                    ("optimizer", 4, 5),
                ],
            )[0]
        )


def test_missing_peer_is_a_note_not_an_error():
    t, _ = template(
        [("forward-compute", 0, 1), ("forward-send", 1, 2), ("optimizer", 2, 3)],
        [("forward-compute", 0, 1), ("optimizer", 2, 3)],
    )
    g = build_graph(t)
    assert g.notes == (
        "stage 0 has 1 launched forward-send op(s) but stage 1 has 0 forward-recv; the extra "
        "ones wait for no peer",
    )


@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_generated_schedules_are_acyclic_and_fully_paired(layout_of, vpp):
    layout = layout_of(JobSpec(dp_size=2, pp_size=4, vpp_size=vpp, microbatches=8, steps=2))
    g = layout_graph(layout)
    assert sorted(g.order) == list(range(2 * layout.nodes))
    assert g.notes == ()
    # Exactly the generator's never-launched ops are detected: one per end stage.
    assert sorted(layout.node_stage[g.noop].tolist()) == [0, 3]
    p2p = np.isin(layout.node_op, list(ot.P2P)) & ~g.noop
    assert all(len(g.peers[n]) == 1 for n in np.flatnonzero(p2p))
    sends = np.flatnonzero(np.isin(layout.node_op, list(ot.P2P_PEER)) & ~g.noop)
    partners = [g.peers[n][0] for n in sends]
    recvs = np.flatnonzero(p2p & ~np.isin(layout.node_op, list(ot.P2P_PEER)))
    assert sorted(partners) == sorted(recvs)
