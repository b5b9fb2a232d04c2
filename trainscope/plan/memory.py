"""Peak memory of one GPU in a (dp, pp, tp, micro-batch) configuration.

Static: weights, gradients and optimizer state of the stage's shard, per parameter

=========  =======  =========================  =======================
precision  weights  gradients                  Adam state
=========  =======  =========================  =======================
fp32       4        4                          8 (two moments)
bf16       2        2                          4
mixed      2        4 (fp32 main-grad buffer)  12 (fp32 master + two moments)
=========  =======  =========================  =======================

(SGD keeps no state, except the fp32 master copy under ``mixed``.) Gradients count as always
allocated, as a framework's contiguous gradient buffer is.

Activations: what one layer saves for its backward, per micro-batch, in elements (b sequences
of s tokens, hidden h, FFN width f, a heads, tp t): the layer input and the two layer-norm
outputs/residual (4bsh, replicated on every tp rank), Q, K, V and the attention output
(4bsh/t), both FFN activations (2bsf/t) and the softmax output (abs²/t), plus the layer norms'
fp32 statistics. With full recomputation a layer saves only its input, and one layer's
activations are rebuilt at a time during the backward. Stage s of a 1F1B pipeline holds
min(m, pp − s) micro-batches in flight (interleaved: its warm-up chunks + 1, each of
layers/(pp·v) layers). On top: the largest transient (attention backward needs two more
score-sized tensors; the loss' fp32 log-softmax and its gradient on the last stage), the pipeline's
buffers (each in-flight output until its backward, the gradients received and sent) and a
fixed allowance for NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscope.plan.spec import GIB, ModelSpec
from trainscope.plan.transformer import ELEMENT_BYTES, ParallelConfig, stage_params

STATIC_BYTES_PER_PARAM = {
    # precision: (weights, gradients, adam state, sgd state)
    "fp32": (4, 4, 8, 0),
    "bf16": (2, 2, 4, 0),
    "mixed": (2, 4, 12, 4),
}
# Communicator workspaces and NCCL's own buffers: not modelled in detail, one allowance per GPU
# whenever there is any communication. Left out when comparing with a single-process count.
NCCL_ALLOWANCE_BYTES = GIB // 2


@dataclass(frozen=True)
class MemoryEstimate:
    stage: int
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # everything saved for backward, all micro-batches in flight
    transient_bytes: int  # the largest short-lived tensors on top, at the peak
    pipeline_bytes: int  # stage outputs held for their backward, send/receive buffers
    nccl_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.process_bytes + self.nccl_bytes

    @property
    def process_bytes(self) -> int:
        """Everything but NCCL's allowance: what one process alone allocates."""
        return (self.weights_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.transient_bytes + self.pipeline_bytes)

    def as_json(self) -> dict[str, float]:
        return {
            "stage": self.stage,
            "total_gib": round(self.total_bytes / GIB, 3),
            "weights_gib": round(self.weights_bytes / GIB, 3),
            "grads_gib": round(self.grads_bytes / GIB, 3),
            "optimizer_gib": round(self.optimizer_bytes / GIB, 3),
            "activations_gib": round(self.activations_bytes / GIB, 3),
            "transient_gib": round(self.transient_bytes / GIB, 3),
            "pipeline_gib": round(self.pipeline_bytes / GIB, 3),
            "nccl_gib": round(self.nccl_bytes / GIB, 3),
        }


def in_flight(cfg: ParallelConfig, microbatches: int, stage: int) -> int:
    """Model chunks whose activations stage ``stage`` holds at once: its warm-up forwards and
    the one in steady state."""
    p, v = cfg.pp, cfg.virtual_stages
    warmup = (p - stage - 1) * 2 + (v - 1) * p if v > 1 else p - stage - 1
    return min(microbatches * v, warmup + 1)


def layer_activation_bytes(model: ModelSpec, cfg: ParallelConfig) -> int:
    b, s, h, f, a, t = (cfg.micro_batch, model.seq_len, model.hidden, model.ffn, model.heads,
                        cfg.tp)
    e = ELEMENT_BYTES[model.precision]
    elements = 4 * b * s * h + 4 * b * s * h // t + 2 * b * s * f // t + a * b * s * s // t
    layer_norm_stats = 2 * 2 * b * s * 4
    return elements * e + layer_norm_stats


def estimate(model: ModelSpec, cfg: ParallelConfig, stage: int) -> MemoryEstimate:
    b, s, h, a, t = cfg.micro_batch, model.seq_len, model.hidden, model.heads, cfg.tp
    e = ELEMENT_BYTES[model.precision]
    params = stage_params(model, cfg, stage)
    w, g, adam, sgd = STATIC_BYTES_PER_PARAM[model.precision]
    state = adam if model.optimizer == "adam" else sgd
    m = cfg.microbatches(model)
    chunks = in_flight(cfg, max(m, 1), stage)
    layers_per_chunk = model.layers // (cfg.pp * cfg.virtual_stages)
    per_layer = layer_activation_bytes(model, cfg)
    hidden_bytes = b * s * h * e
    if model.recompute:
        saved = chunks * layers_per_chunk * hidden_bytes
        rebuilt = per_layer  # one layer at a time during the backward
    else:
        saved = chunks * layers_per_chunk * per_layer
        rebuilt = 0
    scores = a * b * s * s // t * e
    transient = rebuilt + 2 * scores
    if stage == cfg.pp - 1:
        logits_fp32 = b * s * model.vocab // t * 4
        # Saved for backward per micro-batch in flight: the final norm's input and output and
        # the fp32 log-softmax; at the first backward its gradient and the logits' gradient.
        saved += chunks * (2 * hidden_bytes + logits_fp32) if cfg.virtual_stages == 1 else (
            2 * hidden_bytes + logits_fp32)
        transient = max(transient, 2 * logits_fp32)
    pipeline = 0
    if stage < cfg.pp - 1:
        # Each chunk's output stays referenced until its backward (Megatron frees the data
        # early; plain PyTorch does not), plus the received gradient.
        pipeline += (chunks + 1) * hidden_bytes
    if stage > 0:
        pipeline += hidden_bytes  # the input gradient being sent back
    return MemoryEstimate(
        stage=stage,
        weights_bytes=params * w,
        grads_bytes=params * g,
        optimizer_bytes=params * state,
        activations_bytes=saved,
        transient_bytes=transient,
        pipeline_bytes=pipeline,
        nccl_bytes=NCCL_ALLOWANCE_BYTES if cfg.world > 1 else 0,
    )


def worst_stage(model: ModelSpec, cfg: ParallelConfig) -> MemoryEstimate:
    return max((estimate(model, cfg, s) for s in range(cfg.pp)), key=lambda x: x.total_bytes)
