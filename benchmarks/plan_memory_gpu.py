"""The planner's memory estimator against torch.cuda.max_memory_allocated on a real GPU.

For each small GPT configuration, one GPU runs the training step of one pipeline stage's
tensor-parallel shard (trainscope.plan.torch_gpt: the model slice alone, collectives left out)
twice, and the peak of the second step is compared with the estimate and with the meta-device
count the tests use. Needs only torch (with CUDA), numpy, msgspec, pyyaml and trainscope.

    python benchmarks/plan_memory_gpu.py            # < 2 minutes on one H100
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from trainscope.plan.memory import estimate
from trainscope.plan.memtrack import MemoryTracker
from trainscope.plan.spec import ModelSpec
from trainscope.plan.torch_gpt import Slice, build, make_optimizer, train_step
from trainscope.plan.transformer import ParallelConfig

MIB = 2**20


def model(**kw: object) -> ModelSpec:
    base: dict[str, object] = dict(layers=4, hidden=512, heads=8, seq_len=256, vocab=8000,
                                   global_batch=32)
    base.update(kw)
    return ModelSpec(**base)  # type: ignore[arg-type]


CASES = [
    # The tests' configurations (tests/plan/test_memory.py) ...
    (model(precision="fp32"), Slice(pp=1, stage=0, tp=1, micro_batch=2)),
    (model(precision="bf16", seq_len=512), Slice(pp=2, stage=0, tp=2, micro_batch=2)),
    (model(precision="mixed"), Slice(pp=4, stage=3, tp=1, micro_batch=1)),
    (model(precision="mixed", hidden=768, heads=12), Slice(pp=4, stage=1, tp=2, micro_batch=4)),
    (model(precision="bf16", recompute=True), Slice(pp=2, stage=1, tp=1, micro_batch=4)),
    (model(precision="fp32", optimizer="sgd", layers=6), Slice(pp=3, stage=0, tp=1,
                                                               micro_batch=2)),
    (model(precision="mixed", recompute=True, vocab=32000), Slice(pp=1, stage=0, tp=4,
                                                                  micro_batch=2)),
    # ... and GPU-sized whole models (pp = tp = 1).
    (model(layers=12, hidden=1024, heads=16, seq_len=1024, vocab=50304, precision="mixed"),
     Slice(pp=1, stage=0, tp=1, micro_batch=4)),
    (model(layers=24, hidden=2048, heads=16, seq_len=2048, vocab=50304, precision="bf16",
           recompute=True), Slice(pp=1, stage=0, tp=1, micro_batch=2)),
    (model(layers=8, hidden=2048, heads=32, seq_len=1024, vocab=50304, precision="fp32"),
     Slice(pp=1, stage=0, tp=1, micro_batch=2)),
]


def warm_up(device: str) -> None:
    """Let cuBLAS allocate its workspaces (through the caching allocator, once per process and
    dtype) before anything is measured, so the first configuration is not charged for them."""
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(256, 256, device=device, dtype=dtype, requires_grad=True)
        (a @ a).float().sum().backward()
    torch.cuda.synchronize()


def peak_bytes(spec: ModelSpec, part: Slice, device: str) -> int:
    in_flight = part.pp - part.stage
    if device == "meta":
        net = build(spec, part, "meta")
        tracker = MemoryTracker()
        tracker.adopt(list(net.parameters()))
        with tracker:
            optimizer = make_optimizer(spec, net)
            for _ in range(2):
                tracker.reset_peak()
                train_step(spec, part, net, optimizer, in_flight, "meta")
        return tracker.peak_bytes
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    net = build(spec, part, device)
    optimizer = make_optimizer(spec, net)
    train_step(spec, part, net, optimizer, in_flight, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(spec, part, net, optimizer, in_flight, device)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del net, optimizer
    return peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("Error: no CUDA GPU visible to torch (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    if args.device.startswith("cuda"):
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        warm_up(args.device)
    header = (f"{'model':34} {'slice':16} {'estimate':>9} {'meta':>9} {'gpu':>9} "
              f"{'est/gpu':>8} {'meta/gpu':>8}")
    print(header)
    print("-" * len(header))
    worst = 0.0
    for spec, part in CASES:
        cfg = ParallelConfig(dp=1, pp=part.pp, tp=part.tp, micro_batch=part.micro_batch)
        est = estimate(spec, cfg, part.stage).process_bytes
        meta = peak_bytes(spec, part, "meta")
        gpu = peak_bytes(spec, part, args.device)
        worst = max(worst, abs(est / gpu - 1))
        name = (f"L{spec.layers} h{spec.hidden} s{spec.seq_len} {spec.precision}"
                f"{' rc' if spec.recompute else ''} {spec.optimizer}")
        where = f"pp{part.pp}/s{part.stage} tp{part.tp} b{part.micro_batch}"
        print(f"{name:34} {where:16} {est / MIB:8.1f}M {meta / MIB:8.1f}M {gpu / MIB:8.1f}M "
              f"{est / gpu:8.3f} {meta / gpu:8.3f}")
    print(f"\nworst |estimate/gpu - 1| = {worst:.3f}   ({time.perf_counter() - started:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
