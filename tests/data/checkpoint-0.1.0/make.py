"""How checkpoint.bin was made: by trainscope 0.1.0 (commit f886789, the ``trainscope.streams``
layout), so that a stream job upgraded across the move to ``trainscope.engine`` is shown to read
its last checkpoint, open windows included. Runs only against that version:

    PYTHONPATH=<checkout of f886789> python tests/data/checkpoint-0.1.0/make.py
"""

import copy
import json
from pathlib import Path

from trainscope.streams.checkpoint import Checkpoint, encode
from trainscope.streams.delivery import SeenBatches
from trainscope.streams.windows import WindowEngine

from trainscope.detectors.registry import DetectorRunner, load
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster

HERE = Path(__file__).parent
spec = ClusterSpec(job_id="upgraded", dp=4, pp=2, tp=1, steps=40,
                   window_s=15.0)
cluster = SimulatedCluster(spec, [])
engine = WindowEngine(window_s=15.0, allowed_lateness_s=5.0)
for output in cluster.run():
    if output.step == 0:
        engine.add_topology(cluster.topology_records()[0])
    engine.add_summaries(output.summaries)
    engine.add_steps(output.steps)
    engine.add_metrics(output.metrics)
seen = SeenBatches()
seen.first_time(7, 1, 12345)
checkpoint = Checkpoint(
    closed_before_ns=engine.closed_before_ns(), topologies=engine.topologies(),
    world_sizes={"upgraded": 8}, runner=DetectorRunner(load().detectors), seen=seen,
    engine=engine.snapshot(), positions={("trainscope.events", 0): 123},
    committed={("trainscope.events", 0): 100},
)
(HERE / "checkpoint.bin").write_bytes(encode(checkpoint))
views = copy.deepcopy(engine).close_all()
expected = [
    {"window_start_ns": v.window_start_ns, "summaries": len(v.summaries),
     "total_ns": int(v.summaries["total_ns"].sum()), "steps": len(v.steps),
     "metrics": len(v.metrics), "ranks": sorted(int(r) for r in v.summaries["rank"].unique())}
    for v in views
]
(HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
print(f"{len(views)} open windows")
