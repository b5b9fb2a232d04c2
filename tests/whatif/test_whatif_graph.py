import numpy as np
import pytest

from trainscope.whatif import optypes as ot
from trainscope.whatif.analysis import layout_graph
from trainscope.whatif.generate import JobSpec
from trainscope.whatif.graph import build_graph
from trainscope.whatif.trace import TraceError


def nodes(*per_stage):
    """Node arrays from per-stage lists of (optype, gmc, mb)."""
    flat = [(s, *op) for s, ops in enumerate(per_stage) for op in ops]
    stage = np.array([f[0] for f in flat])
    op = np.array([ot.CODE[f[1]] for f in flat])
    gmc = np.array([f[2] for f in flat])
    mb = np.array([f[3] for f in flat])
    seq = np.zeros(len(flat), dtype=int)
    seen: dict = {}
    for i, key in enumerate(zip(stage, op, strict=True)):
        seq[i] = seen.get(key, 0)
        seen[key] = seq[i] + 1
    offsets = np.cumsum([0] + [len(ops) for ops in per_stage])
    return stage, op, seq, np.full(len(flat), -1), gmc, mb, offsets


def test_send_receive_pairs_and_collectives():
    g = build_graph(
        *nodes(
            [
                ("forward-compute", 0, 0),
                ("forward-send", 0, -1),
                ("backward-recv", 0, -1),
                ("backward-compute", 0, 0),
                ("grads-reduce-scatter", 0, -1),
                ("embedding-grads-all-reduce", -1, -1),
                ("optimizer-clip-main-grad", -1, -1),
                ("optimizer", -1, -1),
            ],
            [
                ("forward-recv", 1, -1),
                ("forward-compute", 1, 0),
                ("backward-compute", 1, 0),
                ("backward-send", 1, -1),
                ("embedding-grads-all-reduce", -1, -1),
                ("optimizer-clip-main-grad", -1, -1),
                ("optimizer", -1, -1),
            ],
        )
    )
    assert g.peers[8] == (1,)  # forward-recv on stage 1 ← forward-send of stage 0
    assert g.peers[2] == (11,)  # backward-recv on stage 0 ← backward-send of stage 1
    assert g.peers[1] == ()  # a send waits for nobody
    assert g.peers[5] == (12,) and g.peers[12] == (5,)  # embeddings: first and last stage
    assert g.peers[6] == (13,) and g.dp_wide[6]  # clip: global
    assert g.dp_wide[4] and not g.dp_wide[0]
    assert list(g.pred[:2]) == [-1, 0] and g.pred[8] == -1
    assert list(g.final_nodes) == [7, 14]


def test_cycle_is_detected_and_named():
    # Stage 0 waits for stage 1's backward before sending its forward, stage 1 the reverse.
    with pytest.raises(TraceError, match=r"cycle through: .*backward-recv #0 on stage 0"):
        build_graph(
            *nodes(
                [
                    ("backward-recv", 0, 0),
                    ("forward-compute", 0, 0),
                    ("forward-send", 0, 0),
                    ("optimizer", -1, -1),
                ],
                [
                    ("forward-recv", 1, 0),
                    ("backward-compute", 1, 0),
                    ("backward-send", 1, 0),
                    ("optimizer", -1, -1),
                ],
            )
        )


def test_unmatched_receive_is_an_error():
    with pytest.raises(
        TraceError,
        match=r"forward-recv #0 on stage 1 .*micro-batch 3.* no "
        r"matching forward-send",
    ):
        build_graph(
            *nodes(
                [("forward-compute", 0, 0), ("forward-send", 0, 0), ("optimizer", -1, -1)],
                [("forward-recv", 1, 3), ("forward-compute", 1, 3), ("optimizer", -1, -1)],
            )
        )


@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_generated_schedules_are_acyclic_and_fully_paired(layout_of, vpp):
    layout = layout_of(JobSpec(dp_size=2, pp_size=4, vpp_size=vpp, microbatches=8, steps=2))
    g = layout_graph(layout)
    assert sorted(g.order) == list(range(2 * layout.nodes))
    recvs = np.isin(layout.node_op, [ot.FORWARD_RECV, ot.BACKWARD_RECV])
    partners = [g.peers[n][0] for n in np.flatnonzero(recvs)]
    # Every send is matched by exactly one receive.
    sends = np.flatnonzero(np.isin(layout.node_op, [ot.FORWARD_SEND, ot.BACKWARD_SEND]))
    assert sorted(partners) == sorted(sends.tolist())
