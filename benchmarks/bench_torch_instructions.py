"""Instructions the in-process PyTorch producer adds per training step, counted by callgrind.

Time on a shared VM drifts by tens of percent between blocks of the same loop, so the
time-based benchmark (``bench_torch_overhead.py``) resolves a few µs per step only with
hundreds of rounds. An instruction count is deterministic: the same loop as that benchmark
(``make_loop``) runs under valgrind's callgrind twice, without and with ``trainscope.attach()``,
with instrumentation switched on (``callgrind_control -i on``) only around ``--steps`` steps
after a warm-up, one output file per thread. The training thread's instructions per step,
attached minus baseline, are the producer's cost on that thread; the other threads' (the
sender, the control listener) are printed apart: under callgrind a step takes ~50× longer, so
the sender's rounds (every 0.5 s of wall time) come ~50× more often per step than in a real
run and its figure here is an upper bound, not a per-step cost.

Instructions are not time: Python's interpreter loop and torch's kernels retire different
numbers of instructions per ns, and a real loop's cache misses are not counted. Compare two
trees with it (``--tree``), and read µs from ``bench_torch_overhead.py``.

Needs valgrind (``apt-get install valgrind``). Takes about two minutes per tree.

Usage: ``python benchmarks/bench_torch_instructions.py [--steps 40] [--size 256x32]
[--tree PATH ...]``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# What runs under valgrind: the loop, then instrumentation on around the measured steps.
_CHILD = r"""
import os, subprocess, sys
sys.path.insert(0, {benchmarks!r})
import torch
torch.set_num_threads(1)
import bench_torch_overhead as b
import trainscope
from trainscope.transport.memory import MemoryBus
run = b.make_loop({width}, {batch})
run(30)
handle = None
if {attached}:
    handle = trainscope.attach(bus=MemoryBus(), job_id="instructions", window_s=2.0)
    run(30)  # past discovery and the backward calibration
subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True,
               capture_output=True)
run({steps})
subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True,
               capture_output=True)
if handle is not None:
    handle.detach()
"""


def count(tree: Path, attached: bool, width: int, batch: int, steps: int,
          out_dir: Path) -> dict[int, int]:
    """Instructions per thread (1 = the training thread) of one run under callgrind."""
    name = "attach" if attached else "baseline"
    script = out_dir / f"{name}.py"
    script.write_text(_CHILD.format(benchmarks=str(tree / "benchmarks"), width=width,
                                    batch=batch, attached=attached, steps=steps))
    prefix = out_dir / f"cg.{name}"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # The interpreter itself, not a launcher script: valgrind does not follow an exec.
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    "--separate-threads=yes", f"--callgrind-out-file={prefix}",
                    os.path.realpath(sys.executable), str(script)],
                   check=True, env=env, capture_output=True)
    totals = {}
    for path in out_dir.glob(f"cg.{name}-*"):
        text = path.read_text(errors="replace")
        thread = re.search(r"^thread: (\d+)", text, re.M)
        total = re.search(r"^totals: (\d+)", text, re.M)
        if thread and total:
            totals[int(thread.group(1))] = int(total.group(1))
    if 1 not in totals:
        raise RuntimeError(f"callgrind wrote no count for the training thread of {name}")
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--size", default="256x32", help="model width x batch size")
    parser.add_argument("--tree", type=Path, action="append",
                        help="a checkout to measure (repeatable; default: this one)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench_torch_instructions: valgrind is not installed "
                 "(apt-get install valgrind)")
    width, batch = (int(v) for v in args.size.split("x"))
    trees = args.tree or [Path(__file__).resolve().parent.parent]
    print(f"MLP width {width}, batch {batch}, {args.steps} steps counted; "
          "instructions per step (Ir)")
    for tree in trees:
        with tempfile.TemporaryDirectory() as tmp:
            base = count(tree, False, width, batch, args.steps, Path(tmp))
            attach = count(tree, True, width, batch, args.steps, Path(tmp))
        step = base[1] / args.steps
        extra = (attach[1] - base[1]) / args.steps
        others = sum(v for k, v in attach.items() if k != 1) / args.steps
        print(f"{tree}: baseline training thread {step:,.0f}; attach adds {extra:,.0f} "
              f"({extra / step:.2%}) on the training thread; other threads {others:,.0f} "
              "(an upper bound, see above)")


if __name__ == "__main__":
    main()
