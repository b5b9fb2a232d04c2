"""The findings of every built-in detector on a fixed set of simulated faults, pinned.

One job per fault kind the demo offers, and a healthy one (16 ranks, dp 4 × pp 2 × tp 2, a
fixed seed and start time), through the embedded stream job with every built-in detector. What
each window concluded (detector, category, rank, stage, function, victims, score to 3 places,
the message) must equal ``tests/data/findings-golden.json``: a change made for speed must not
change a single finding. A change to what the detectors conclude fails here too; when that is
the intent, rewrite the file and say in the commit what changed and why:

    python tests/detectors/test_findings_golden.py --update
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from trainscope.engine.embedded_job import EmbeddedStreamJob
from trainscope.producers.simulate import ClusterSpec, SimulatedCluster, parse_faults

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "findings-golden.json"
WINDOW_S = 15.0
CASES: dict[str, list[str]] = {
    "healthy": [],
    "slow-gpu": ["slow-gpu:rank=13,factor=1.4,start=30"],
    "throttle": ["throttle:rank=6,mhz=1200,start=30"],
    "slow-link": ["slow-link:rank=9,factor=3,start=30"],
    "dataloader-stall": ["dataloader-stall:rank=2,ms=120,start=30"],
    "gc-pause": ["gc-pause:rank=11,ms=40,every=2,start=30"],
    "stage-imbalance": ["stage-imbalance:stage=1,factor=1.3,start=30"],
    "seq-imbalance": ["seq-imbalance:spread=0.3,start=30"],
    "two-faults": ["slow-gpu:rank=3,factor=1.6,start=30",
                   "gc-pause:rank=12,ms=60,every=5,start=40"],
}


def findings_of(faults: list[str]) -> list[dict[str, Any]]:
    spec = ClusterSpec(dp=4, pp=2, tp=2, steps=120, seed=11, window_s=WINDOW_S)
    job = EmbeddedStreamJob(None, window_s=WINDOW_S)
    cluster = SimulatedCluster(spec, parse_faults(faults))
    job.process_records(cluster.topology_records())
    for output in cluster.run():
        job.process_records([*output.summaries, *output.steps, *output.metrics])
    job.finish()
    window_ns = int(WINDOW_S * 1e9)
    rows = [
        {
            "window": (f.window_start_ns - spec.start_ns) // window_ns,
            "detector": f.detector,
            "category": f.category,
            "rank": f.rank,
            "pp_stage": f.pp_stage,
            "function": f.function,
            "victims": len(f.victims),
            "score": round(f.score, 3),
            "message": f.message,
        }
        for f in job.findings
    ]
    return sorted(rows, key=lambda r: (r["window"], r["detector"], r["category"], r["rank"],
                                       r["function"]))


@pytest.mark.parametrize("case", list(CASES))
def test_findings_are_those_pinned(case: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert findings_of(CASES[case]) == golden[case], (
        f"the findings of case {case!r} changed; if intended, rerun with --update (module doc)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit(__doc__)
    GOLDEN.write_text(json.dumps({case: findings_of(f) for case, f in CASES.items()}, indent=1)
                      + "\n")
    print(f"wrote {GOLDEN}")
