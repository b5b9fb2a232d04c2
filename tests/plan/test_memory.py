"""The memory estimator against an exact count of a small GPT's training step on the meta device.

The count is independent of the estimator: a dispatch-mode tracker adds up the storages PyTorch
really allocates and frees while the model of :mod:`trainscope.plan.torch_gpt` runs its
forwards, backwards and optimizer step (the second step, so optimizer state exists).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the dev extra) for the exact count")

from trainscope.plan.memory import NCCL_ALLOWANCE_BYTES, estimate  # noqa: E402
from trainscope.plan.memtrack import MemoryTracker  # noqa: E402
from trainscope.plan.spec import ModelSpec  # noqa: E402
from trainscope.plan.torch_gpt import Slice, build, make_optimizer, train_step  # noqa: E402
from trainscope.plan.transformer import ParallelConfig  # noqa: E402


def meta_peak_bytes(model_spec: ModelSpec, part: Slice, in_flight: int | None = None) -> int:
    model = build(model_spec, part, "meta")
    tracker = MemoryTracker()
    tracker.adopt(list(model.parameters()))
    with tracker:
        optimizer = make_optimizer(model_spec, model)
        for _ in range(2):
            tracker.reset_peak()
            train_step(model_spec, part, model, optimizer,
                       part.pp - part.stage if in_flight is None else in_flight, "meta")
    return tracker.peak_bytes


def small(**kw: object) -> ModelSpec:
    base: dict[str, object] = dict(layers=4, hidden=512, heads=8, seq_len=256, vocab=8000,
                                   global_batch=32)
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


CASES = [
    (small(precision="fp32"), Slice(pp=1, stage=0, tp=1, micro_batch=2)),
    (small(precision="bf16", seq_len=512), Slice(pp=2, stage=0, tp=2, micro_batch=2)),
    (small(precision="mixed"), Slice(pp=4, stage=3, tp=1, micro_batch=1)),
    (small(precision="mixed", hidden=768, heads=12), Slice(pp=4, stage=1, tp=2, micro_batch=4)),
    (small(precision="bf16", recompute=True), Slice(pp=2, stage=1, tp=1, micro_batch=4)),
    (small(precision="fp32", optimizer="sgd", layers=6), Slice(pp=3, stage=0, tp=1,
                                                               micro_batch=2)),
    (small(precision="mixed", recompute=True, vocab=32000), Slice(pp=1, stage=0, tp=4,
                                                                  micro_batch=2)),
]


@pytest.mark.parametrize(("model_spec", "part"), CASES,
                         ids=[f"{m.precision}-pp{p.pp}s{p.stage}-tp{p.tp}-b{p.micro_batch}"
                              for m, p in CASES])
def test_estimate_within_10_percent_of_the_meta_device_count(model_spec, part) -> None:
    counted = meta_peak_bytes(model_spec, part)
    cfg = ParallelConfig(dp=1, pp=part.pp, tp=part.tp, micro_batch=part.micro_batch)
    est = estimate(model_spec, cfg, part.stage)
    # The single process has no communicator: compare without NCCL's allowance.
    assert est.total_bytes - est.process_bytes in (0, NCCL_ALLOWANCE_BYTES)
    assert est.process_bytes == pytest.approx(counted, rel=0.10), (
        f"estimate {est.process_bytes / 2**20:.1f} MiB, counted {counted / 2**20:.1f} MiB"
    )


def test_the_count_sees_activations_grow_with_micro_batches_in_flight() -> None:
    """The tracker is not blind: holding more micro-batches costs what the estimator says."""
    spec = small(precision="bf16")
    part = Slice(pp=4, stage=1, tp=1, micro_batch=2)
    one = meta_peak_bytes(spec, part, in_flight=1)
    three = meta_peak_bytes(spec, part, in_flight=3)
    cfg = ParallelConfig(dp=1, pp=4, tp=1, micro_batch=2)
    per_mb = estimate(spec, cfg, 1).activations_bytes / 3
    assert (three - one) / 2 == pytest.approx(per_mb, rel=0.15)
