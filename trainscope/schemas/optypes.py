"""The Megatron-LM timer op types and how the dependency model treats each of them.

Compute-type ops (forward and backward compute, the optimizer and the host-side ``gc`` pause)
are replaced by the mean duration of their type in the ideal run; every other op is
communication and is replaced by the median *transfer* duration of its type (the time from the
last group member's start to the op's end), because its observed duration includes waiting for
peers.
"""

from __future__ import annotations

# Codes are positions in this tuple; new names go at the end so stored codes keep their meaning.
OPTYPES: tuple[str, ...] = (
    "forward-compute",
    "backward-compute",
    "forward-send",
    "forward-recv",
    "backward-send",
    "backward-recv",
    "params-all-gather",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
    "optimizer",
    "gc",
)
CODE: dict[str, int] = {name: i for i, name in enumerate(OPTYPES)}

FORWARD_COMPUTE = CODE["forward-compute"]
BACKWARD_COMPUTE = CODE["backward-compute"]
FORWARD_SEND = CODE["forward-send"]
FORWARD_RECV = CODE["forward-recv"]
BACKWARD_SEND = CODE["backward-send"]
BACKWARD_RECV = CODE["backward-recv"]
PARAMS_ALL_GATHER = CODE["params-all-gather"]
GRADS_REDUCE_SCATTER = CODE["grads-reduce-scatter"]
SEPARATE_ALL_REDUCE = CODE["separate-grads-all-reduce"]
LAYERNORM_ALL_REDUCE = CODE["layernorm-grads-all-reduce"]
EMBEDDING_ALL_REDUCE = CODE["embedding-grads-all-reduce"]
CLIP = CODE["optimizer-clip-main-grad"]
OPTIMIZER = CODE["optimizer"]
GC = CODE["gc"]

COMPUTE: frozenset[int] = frozenset({FORWARD_COMPUTE, BACKWARD_COMPUTE, OPTIMIZER, GC})
P2P: tuple[int, ...] = (FORWARD_SEND, FORWARD_RECV, BACKWARD_SEND, BACKWARD_RECV)
# The compute op each point-to-point type belongs to: a recv feeds it, a send follows it.
P2P_COMPUTE: dict[int, int] = {
    FORWARD_SEND: FORWARD_COMPUTE,
    FORWARD_RECV: FORWARD_COMPUTE,
    BACKWARD_SEND: BACKWARD_COMPUTE,
    BACKWARD_RECV: BACKWARD_COMPUTE,
}
# A send on stage s is received on stage s + direction by this type.
P2P_PEER: dict[int, tuple[int, int]] = {
    FORWARD_SEND: (FORWARD_RECV, 1),
    BACKWARD_SEND: (BACKWARD_RECV, -1),
}
# Completes only when every data-parallel peer of the same stage has started it.
DP_COLLECTIVES: frozenset[int] = frozenset(
    {PARAMS_ALL_GATHER, GRADS_REDUCE_SCATTER, SEPARATE_ALL_REDUCE}
)


def is_compute(code: int) -> bool:
    return code in COMPUTE
