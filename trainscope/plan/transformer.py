"""Arithmetic of a GPT model cut into pipeline stages and tensor-parallel shards.

Counts are for the layout of Megatron-LM (and of :mod:`.torch_gpt`): untied input embedding
and output head, learned positions; in a tensor-parallel shard the QKV and first FFN weights
are split by columns, the attention output and second FFN weights by rows (their biases stay
whole), the vocabulary is split, and layer norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscope.plan.spec import ModelSpec

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "mixed": 2}  # weights and activations


@dataclass(frozen=True)
class ParallelConfig:
    dp: int
    pp: int
    tp: int
    micro_batch: int  # sequences per micro-batch
    virtual_stages: int = 1  # model chunks per GPU (interleaved 1F1B when > 1)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    def microbatches(self, model: ModelSpec) -> int:
        """Micro-batches per step on each data-parallel replica."""
        return model.global_batch // (self.dp * self.micro_batch)

    def label(self) -> str:
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"dp{self.dp} pp{self.pp} tp{self.tp} mb{self.micro_batch}{v}"

    def problem(self, model: ModelSpec, gpus_per_host: int) -> str | None:
        """Why this configuration cannot run the model, or None."""
        chunks = self.pp * self.virtual_stages
        if model.layers % chunks:
            return f"{model.layers} layers do not split into {chunks} model chunks"
        if model.heads % self.tp or model.ffn % self.tp or model.vocab % self.tp:
            return f"heads, FFN width or vocabulary do not split into tp {self.tp} shards"
        if gpus_per_host % self.tp:
            return f"tp {self.tp} groups do not tile hosts of {gpus_per_host} GPUs"
        if model.global_batch % (self.dp * self.micro_batch):
            return (f"global batch {model.global_batch} is not a multiple of dp {self.dp} × "
                    f"micro-batch {self.micro_batch}")
        m = self.microbatches(model)
        if self.virtual_stages > 1 and m % self.pp:
            return f"interleaving needs micro-batches ({m}) divisible by pp ({self.pp})"
        return None


def layer_params(model: ModelSpec, tp: int) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank."""
    h, f = model.hidden, model.ffn
    column = (3 * h * h + 3 * h + h * f + f) // tp  # QKV and FFN-in weights and biases
    row = (h * h + f * h) // tp + 2 * h  # attention-out and FFN-out weights; whole biases
    return column + row + 4 * h  # two layer norms


def stage_params(model: ModelSpec, cfg: ParallelConfig, stage: int) -> int:
    """Parameters one GPU of pipeline stage ``stage`` holds (all its virtual chunks)."""
    layers = model.layers // cfg.pp
    n = layers * layer_params(model, cfg.tp)
    h = model.hidden
    if stage == 0:
        n += model.vocab // cfg.tp * h + model.seq_len * h
    if stage == cfg.pp - 1:
        n += 2 * h + model.vocab // cfg.tp * h
    return n


def layer_forward_flops(model: ModelSpec, micro_batch: int) -> float:
    """FLOPs of one layer's forward for one micro-batch, the whole layer (all tp shards)."""
    b, s, h, f = micro_batch, model.seq_len, model.hidden, model.ffn
    return 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h


def head_forward_flops(model: ModelSpec, micro_batch: int) -> float:
    return 2 * micro_batch * model.seq_len * model.hidden * model.vocab


def stage_forward_flops(model: ModelSpec, cfg: ParallelConfig) -> list[float]:
    """FLOPs of one micro-batch's forward on each stage (all tp shards together)."""
    layers = model.layers // cfg.pp
    out = [layers * layer_forward_flops(model, cfg.micro_batch)] * cfg.pp
    out[-1] += head_forward_flops(model, cfg.micro_batch)
    return out
