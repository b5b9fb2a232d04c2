"""How measurements become links: per-rank NIC caps, and pair measurements that only a slow
host pair explains."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import yaml

from trainscope.plan.measured import JobLinks, Measured
from trainscope.plan.spec import GBIT, ClusterSpec

BASE = ClusterSpec(hosts=1, gpus_per_host=4, gpu_memory_gib=80, peak_tflops=989)


def job(**kw: object) -> JobLinks:
    # dp 2 × pp 2 × tp 1 on 2 hosts × 2 GPUs: stage s on host s.
    coords = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]])
    links = JobLinks("j", 2, 2, 1, ["a", "b"], 2, np.arange(4), coords, now_ns=10**18)
    for rank in range(4):
        links.nic[rank] = Measured(200 * GBIT, 5, 10**18 - 10**9)
    for key, value in kw.items():
        setattr(links, key, value)
    return links


def test_nic_figures_become_caps_and_the_median_the_nominal_bandwidth() -> None:
    j = job()
    j.nic[1] = Measured(50 * GBIT, 5, 10**18)
    cluster = j.cluster(BASE)
    assert (cluster.hosts, cluster.gpus_per_host) == (2, 2)
    assert cluster.inter_host_gbit_per_s == 200
    links = j.links(cluster)
    assert links.between(np.array(1), np.array(3)) == 50 * GBIT  # GPU 1 is slow ...
    assert links.between(np.array(0), np.array(2)) == 200 * GBIT
    assert links.between(np.array(0), np.array(1)) == BASE.intra_host_gbit_per_s * GBIT  # inside
    assert "slow: rank 1 (a GPU 1) 50 Gb/s" in "\n".join(j.coverage_lines())


def test_a_pair_slower_than_its_ends_marks_the_host_pair() -> None:
    j = job()
    j.pairs[(0, 2)] = Measured(20 * GBIT, 3, 10**18)  # both ends' NICs run at 200
    links = j.links(j.cluster(BASE))
    assert links.host_bytes_per_s[0, 1] == links.host_bytes_per_s[1, 0] == 20 * GBIT


def test_a_pair_its_slow_end_explains_marks_nothing_more() -> None:
    j = job()
    j.nic[0] = Measured(60 * GBIT, 5, 10**18)
    j.pairs[(0, 2)] = Measured(58 * GBIT, 3, 10**18)
    links = j.links(j.cluster(BASE))
    assert links.host_bytes_per_s[0, 1] == 200 * GBIT
    assert links.gpu_cap_bytes_per_s[0] == 60 * GBIT


def test_current_placement_as_slots() -> None:
    assert job().current_slots().tolist() == [[0, 2], [1, 3]]
    shuffled = job(gpu_of_rank=np.array([3, 1, 2, 0]))
    assert shuffled.current_slots().tolist() == [[3, 2], [1, 0]]


def test_a_job_without_link_measurements_is_a_one_line_error(tmp_path) -> None:
    """A job the store knows (its topology) but whose ranks sent no NIC figures or pipeline
    sends: planning from it says what is missing instead of assuming nominal links."""
    pytest.importorskip("chdb", reason="needs the embedded ClickHouse engine (embedded extra)")
    from trainscope.producers.simulate.layout import Layout
    from trainscope.sinks.clickhouse import ClickHouseSink

    store = tmp_path / "store"
    sink = ClickHouseSink.open(store)
    sink.write_topology(Layout(2, 2, 2).topology("quiet-job"))
    sink.close()
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump({
        "model": dict(layers=8, hidden=1024, heads=16, seq_len=1024, vocab=1024,
                      global_batch=16),
        "cluster": dict(hosts=1, gpus_per_host=8, gpu_memory_gib=80, peak_tflops=989),
    }), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "trainscope.cli.main", "plan", str(plan_file),
                           "--from-job", "quiet-job", "--store", str(store)],
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: job 'quiet-job': the store has no link measurements")
