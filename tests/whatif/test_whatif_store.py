"""The --job path against an embedded ClickHouse (chDB) store.

chDB allows one store directory per process, so the store work runs in a child process and
never collides with other tests' stores.
"""

import json
import subprocess
import sys
import textwrap

from trainscope.whatif.generate import Injection, JobSpec

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from click.testing import CliRunner
    from trainscope.whatif import store
    from trainscope.cli.whatif import whatif

    trace, meta, store_dir, misfit = sys.argv[1:5]
    runner = CliRunner()
    imported = runner.invoke(whatif, ["--trace", trace, "--meta", meta, "--job", "job-7",
                                      "--store", store_dir, "--json"])
    again = runner.invoke(whatif, ["--trace", trace, "--meta", meta, "--job", "job-7",
                                   "--store", store_dir, "--json"])
    from_store = runner.invoke(whatif, ["--job", "job-7", "--store", store_dir, "--json"])
    unknown = runner.invoke(whatif, ["--job", "nope", "--store", store_dir])
    bad = runner.invoke(whatif, ["--trace", misfit, "--meta", meta, "--job", "job-8",
                                 "--store", store_dir, "--json"])
    client = store.connect(store_dir)
    query = "SELECT count() FROM op_traces FINAL WHERE job_id = 'job-7'"
    rows = client.query(query).result_rows[0][0]
    results = store.read_results(client, "job-7")
    print(json.dumps({
        "codes": [imported.exit_code, again.exit_code, from_store.exit_code, unknown.exit_code],
        "unknown": unknown.output,
        "imported": json.loads(imported.stdout),
        "from_store": json.loads(from_store.stdout),
        "op_rows": rows,
        "misfit_code": bad.exit_code,
        "misfit_stored": [r["fit"] for r in store.read_results(client, "job-8")],
        "results": [{k: r[k] for k in ("job_id", "S", "M_W", "steps", "workers", "fit",
                                       "S_worker_json", "S_stage")} for r in results],
    }, default=float))
    """
)


def test_job_path_reads_op_traces_and_writes_whatif_results(trace_files, tmp_path):
    spec = JobSpec(
        dp_size=4,
        pp_size=2,
        steps=[0, 4, 8],
        seed=13,
        injections=(Injection("backward-compute", 0.01, dp_rank=3, stage=1),),
    )
    trace, meta = trace_files(spec)
    import pandas as pd

    # The same job with forward computes recorded 3× too long: no dependency model fits it.
    misfit = tmp_path / "misfit.parquet"
    stretched = pd.read_parquet(trace)
    stretched.loc[stretched["optype"] == "forward-compute", "duration"] *= 3
    stretched.to_parquet(misfit)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(trace), str(meta), str(tmp_path / "store"), str(misfit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["codes"][:3] == [0, 0, 0] and out["codes"][3] != 0
    assert "job 'nope': no op trace in the store" in out["unknown"]
    n_rows = len(pd.read_parquet(trace))
    assert out["op_rows"] == n_rows  # imported twice, stored once
    imported, from_store = out["imported"], out["from_store"]
    assert from_store["S"] == imported["S"]
    assert (
        from_store["S_worker"][0]
        == imported["S_worker"][0]
        == {"dp_rank": 3, "stage": 1, "score": imported["S_worker"][0]["score"]}
    )
    assert len(out["results"]) == 3
    latest = out["results"][-1]
    assert latest["job_id"] == "job-7" and latest["steps"] == 3 and latest["workers"] == 8
    assert latest["fit"] == imported["fit"] == 0
    assert latest["S"] == from_store["S"]
    assert json.loads(latest["S_worker_json"])[0]["dp_rank"] == 3
    assert set(latest["S_stage"]) == {"0", "1"}
    assert out["misfit_code"] == 0 and out["misfit_stored"][0] != 0
