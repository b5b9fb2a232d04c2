"""What ``attach()`` costs a ``torch.compile``d model: its graphs, graph breaks and step time.

Each round runs the same compiled MLP training loop twice, each in a fresh process pinned to
one core (one thread): without trainscope and with ``attach()``. A process compiles the model
(the first steps), warms up, then times ``--steps`` steps by its CPU time. Printed per run:
the first steps' CPU seconds (compiling, from the compile cache after the first run), the
CPU time per settled step, and torch.compile's count of compiled graphs and graph breaks.
``PYTHONPATH`` picks the trainscope tree under test (e.g. a checkout of an older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time
import torch, torch.nn as nn
import torch._dynamo.utils as du

os.sched_setaffinity(0, {int(sys.argv[3])})
torch.set_num_threads(1)
width, steps, attach = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4] == "1"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.c = nn.Linear(width, 10)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


if attach:
    import trainscope
    trainscope.attach(job_id="bench-compile")
model = torch.compile(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, width), torch.randint(0, 10, (64,))


def step():
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


t = time.process_time()
for _ in range(3):
    step()
first_s = time.process_time() - t
for _ in range(50):
    step()
t = time.process_time()
for _ in range(steps):
    step()
print(json.dumps({"first_s": first_s, "step_us": (time.process_time() - t) / steps * 1e6,
                  "graphs": du.counters["stats"]["unique_graphs"],
                  "breaks": sum(du.counters["graph_break"].values())}))
"""


def run(width: int, steps: int, cpu: int, attach: bool) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(width), str(steps), str(cpu),
                           "1" if attach else "0"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--cpu", type=int, default=min(os.sched_getaffinity(0)))
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"plain": [], "attach": []}
    for _ in range(args.rounds):
        for name in results:
            r = run(args.width, args.steps, args.cpu, name == "attach")
            results[name].append(r)
            print(f"{name:7s} first 3 steps {r['first_s']:6.2f} s  step {r['step_us']:8.1f} us"
                  f"  graphs {r['graphs']}  breaks {r['breaks']}", flush=True)
    plain = statistics.median(r["step_us"] for r in results["plain"])
    attached = statistics.median(r["step_us"] for r in results["attach"])
    print(f"median step: plain {plain:.1f} us, attach {attached:.1f} us, "
          f"ratio {attached / plain:.3f}")


if __name__ == "__main__":
    main()
