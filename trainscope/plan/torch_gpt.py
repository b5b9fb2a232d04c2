"""A small GPT whose training step is the memory estimator's independent reference.

It builds what one GPU of a (pp, tp) job holds: the layers of one pipeline stage, with every
tensor-parallel weight cut to one rank's shard (heads, FFN columns and vocabulary divided by tp;
layer norms and row-parallel biases replicated, as in Megatron-LM). The collectives are left
out: they move data but an all-reduce's output has the shape of its input, so memory is the
same. A 1F1B pipeline stage keeps the activations of several micro-batches alive; ``in_flight``
forwards run before the first backward, as on stage s of a 1F1B schedule (in_flight = pp − s).

Attention is written out (scores, softmax, weighted sum) rather than a fused kernel, so it
saves the same tensors on every device; the estimator models exactly that.

torch is imported only here and in :mod:`.memtrack`; the planner itself never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainscope.plan.spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "mixed": torch.bfloat16}


@dataclass(frozen=True)
class Slice:
    """Which part of the model one GPU runs."""

    pp: int = 1
    stage: int = 0
    tp: int = 1
    micro_batch: int = 1

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, tp: int) -> None:
        super().__init__()
        h, f = spec.hidden, spec.ffn
        self.heads = spec.heads // tp
        self.head_dim = h // spec.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h // tp)
        self.proj = nn.Linear(h // tp, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, f // tp)
        self.fc2 = nn.Linear(f // tp, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a, d = self.heads, self.head_dim
        q, k, v = self.qkv(self.ln1(x)).split(a * d, dim=-1)
        q, k, v = (t.reshape(b, s, a, d).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, a * d)
        x = x + self.proj(out)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class StageModel(nn.Module):
    def __init__(self, spec: ModelSpec, part: Slice) -> None:
        super().__init__()
        if spec.layers % part.pp:
            raise ValueError(f"{spec.layers} layers do not split into {part.pp} stages")
        self.spec, self.part = spec, part
        h = spec.hidden
        if part.first:
            self.embed = nn.Embedding(spec.vocab // part.tp, h)
            self.pos = nn.Embedding(spec.seq_len, h)
        self.blocks = nn.ModuleList(Block(spec, part.tp) for _ in range(spec.layers // part.pp))
        if part.last:
            self.ln_f = nn.LayerNorm(h)
            self.head = nn.Linear(h, spec.vocab // part.tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens (first stage) or hidden states in; hidden states or the loss out."""
        if self.part.first:
            x = self.embed(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.spec.recompute else block(x)
        if not self.part.last:
            return x
        logits = self.head(self.ln_f(x)).float()
        target = torch.zeros(logits.shape[:2], dtype=torch.long, device=x.device)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(spec: ModelSpec, part: Slice, device: str | torch.device) -> StageModel:
    with torch.device(device):
        model = StageModel(spec, part)
    return model.to(DTYPES[spec.precision])


def make_optimizer(spec: ModelSpec, model: nn.Module) -> torch.optim.Optimizer:
    """``foreach=False``: the per-tensor loop, whose temporaries are one tensor at a time (the
    estimator leaves the optimizer's transient buffers out). ``mixed`` precision keeps fp32
    master weights; the optimizer then runs on those."""
    params = list(model.parameters())
    if spec.precision == "mixed":
        # Megatron-style: the fp32 main-grad buffer takes each 16-bit gradient as soon as it
        # is complete, and the 16-bit gradient is freed.
        masters = [p.detach().float().requires_grad_() for p in params]
        for p, master in zip(params, masters, strict=True):
            master.grad = torch.zeros_like(master)
            p.register_post_accumulate_grad_hook(_into(master))
        params = masters
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-4, foreach=False)
    return torch.optim.SGD(params, lr=1e-4, foreach=False)


def _into(master: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        master.grad.add_(p.grad)
        p.grad = None

    return hook


def train_step(
    spec: ModelSpec,
    part: Slice,
    model: StageModel,
    optimizer: torch.optim.Optimizer,
    in_flight: int,
    device: str | torch.device,
) -> None:
    """``in_flight`` forwards, then their backwards, then the optimizer step. Gradients are
    kept between steps (zeroed, not freed), as a framework's contiguous gradient buffer is."""
    b, s, h = part.micro_batch, spec.seq_len, spec.hidden
    pending = []
    for _ in range(in_flight):
        if part.first:
            x = torch.zeros(b, s, dtype=torch.long, device=device)
        else:
            # The forward receive buffer: this micro-batch's input, kept for its backward.
            x = torch.zeros(b, s, h, dtype=DTYPES[spec.precision], device=device,
                            requires_grad=True)
        pending.append((x, model(x)))
    del x
    while pending:
        x, out = pending.pop(0)
        if part.last:
            out.backward()
        else:
            # The backward receive buffer: the gradient from the next stage.
            out.backward(torch.ones_like(out))
        x.grad = None  # sent to the previous stage
        del x, out
    optimizer.step()
    if spec.precision == "mixed":
        with torch.no_grad():
            for master, p in zip(optimizer.param_groups[0]["params"], model.parameters(),
                                 strict=True):
                p.copy_(master)
                master.grad.zero_()
    else:
        model.zero_grad(set_to_none=False)
