"""The Megatron-LM timer op types and how the dependency model treats each of them.

Compute ops are replaced by the mean duration of their type in the ideal run; every other op is
communication and is replaced by the median *transfer* duration of its type (the time from the
last peer's start to the op's end), because its observed duration includes waiting for peers.
"""

from __future__ import annotations

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
)
CODE: dict[str, int] = {name: i for i, name in enumerate(OPTYPES)}

FORWARD_COMPUTE = CODE["forward-compute"]
BACKWARD_COMPUTE = CODE["backward-compute"]
FORWARD_SEND = CODE["forward-send"]
FORWARD_RECV = CODE["forward-recv"]
BACKWARD_SEND = CODE["backward-send"]
BACKWARD_RECV = CODE["backward-recv"]
OPTIMIZER = CODE["optimizer"]
CLIP = CODE["optimizer-clip-main-grad"]
EMBEDDING_ALL_REDUCE = CODE["embedding-grads-all-reduce"]

COMPUTE: frozenset[int] = frozenset({FORWARD_COMPUTE, BACKWARD_COMPUTE, OPTIMIZER})
# Completes only when every data-parallel peer of the same stage has started it.
DP_COLLECTIVES: frozenset[int] = frozenset(
    CODE[n] for n in ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce")
)
# Layernorm grads are all-reduced over the tensor-parallel group, whose peers are inside each
# op of the trace, so this op waits for nobody outside its own worker.
# The grad-norm all-reduce of gradient clipping spans the whole job: it is a global barrier.
GLOBAL_COLLECTIVES: frozenset[int] = frozenset({CLIP})
# Word embeddings are shared by the first and the last pipeline stage of a data-parallel rank.
STAGE_COLLECTIVES: frozenset[int] = frozenset({EMBEDDING_ALL_REDUCE})


def is_compute(code: int) -> bool:
    return code in COMPUTE
