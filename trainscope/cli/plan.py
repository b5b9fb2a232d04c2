"""``trainscope plan``: recommend a 3D-parallel configuration and placement."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from trainscope.plan.spec import GIB, PlanInputError


@click.command("plan")
@click.argument("plan_file", type=click.Path(path_type=Path))
@click.option("--top-k", type=click.IntRange(1), help="How many configurations to show "
              "(default: search.top_k of the file, 5).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the search.")
@click.option("--from-job", "job_id", help="Take hosts, GPUs and link bandwidths from what "
              "this job measured (needs --store or --url); also says how much faster the job "
              "would run re-placed.")
@click.option("--store", type=click.Path(path_type=Path), help="chDB store directory.")
@click.option("--url", help="ClickHouse server URL instead of a store.")
@click.option("--job-micro-batch", type=click.IntRange(1), default=1, show_default=True,
              help="The running job's micro-batch size (the store does not record it).")
@click.option("--calibrate", is_flag=True, help="With --from-job: take the share of peak "
              "FLOP/s (mfu) and the backward/forward ratio from the job's measured forward and "
              "backward times. Only meaningful when PLAN_FILE describes the job's own model "
              "and --job-micro-batch its micro-batch size.")
@click.option("--show-rejected", is_flag=True, help="List every configuration left out, "
              "with the reason.")
def plan(plan_file: Path, top_k: int | None, as_json: bool, seed: int, job_id: str | None,
         store: Path | None, url: str | None, job_micro_batch: int, calibrate: bool,
         show_rejected: bool) -> None:
    """Recommend (dp, pp, tp, micro-batch) and a rank → GPU placement for PLAN_FILE's model.

    PLAN_FILE is YAML with a `model` and a `cluster` section (and optional `search`); see
    docs/planning.md. Configurations that do not fit in GPU memory
    are never recommended. Step times are those of the critical-path model of the 1F1B
    schedule on the given (or measured) links; placements come from simulated annealing.
    With --from-job, the cluster's hosts, GPUs per host and network bandwidths are replaced
    by the job's topology and measurements (GPU memory, peak FLOP/s and NVLink bandwidth stay
    from the file).
    """
    import msgspec

    from trainscope.plan.measured import MeasuredError
    from trainscope.plan.recommend import plan as make_plan
    from trainscope.plan.spec import Links, load_plan_file

    if job_id is None and (store is not None or url is not None):
        raise click.UsageError("--store/--url only go with --from-job")
    if job_id is not None and (store is None) == (url is None):
        raise click.UsageError("--from-job needs exactly one of --store DIR or --url URL")
    if calibrate and job_id is None:
        raise click.UsageError("--calibrate needs --from-job")
    try:
        spec = load_plan_file(plan_file)
        assert spec.cluster is not None
        search_spec = spec.search
        if top_k is not None:
            search_spec = msgspec.structs.replace(search_spec, top_k=top_k)
        job = None
        calibration = None
        cluster = spec.cluster
        if job_id is not None:
            job = _read_job(job_id, store, url)
            cluster = job.cluster(cluster)
            if calibrate:
                cluster, calibration = job.calibrate(spec.model, cluster, job_micro_batch)
            links = job.links(cluster)
        else:
            links = Links.of(cluster)
        result = make_plan(spec.model, cluster, links, search_spec, seed=seed)
        whatif = (_job_whatif(job, spec.model, cluster, links, job_micro_batch, seed)
                  if job is not None else None)
    except (PlanInputError, MeasuredError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        out = _as_json(result, job, whatif)
        if calibration is not None:
            out["calibration"] = calibration
        click.echo(json.dumps(out, indent=2))
    else:
        if calibration is not None:
            click.echo(
                f"Compute calibrated on job {job_id}: forward {calibration['forward_ms_median']}"
                f" ms per micro-batch (median of {calibration['ranks']} ranks) → mfu "
                f"{calibration['mfu']:.3f} (file: {calibration['file_mfu']:g}), backward "
                f"{calibration['backward_over_forward']:.2f}× forward")
        _print(result, job, whatif, show_rejected)


def _read_job(job_id: str, store: Path | None, url: str | None) -> Any:
    from trainscope.plan.measured import read_job_links
    from trainscope.store.client import StoreError, connect

    try:
        client = connect(store, url, readonly=True, create=False)
        return read_job_links(client, job_id)
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _job_whatif(job: Any, model: Any, cluster: Any, links: Any, micro_batch: int,
                seed: int) -> dict[str, Any]:
    """The running job's own configuration: as placed now, and re-placed."""
    from trainscope.plan.costs import stage_costs
    from trainscope.plan.latency import LatencyModel
    from trainscope.plan.recommend import placement_json, slow_links_used
    from trainscope.plan.search import search

    cfg = job.config(micro_batch)
    problem = cfg.problem(model, cluster.gpus_per_host)
    if problem:
        return {"config": cfg.label(), "error": f"the plan file's model does not fit the job's "
                f"configuration {cfg.label()}: {problem}"}
    slots = job.current_slots()
    if slots is None:
        return {"config": cfg.label(), "error": "the job's tensor-parallel groups are not "
                "consecutive GPUs of one host; its placement cannot be scored"}
    latency = LatencyModel(cfg, stage_costs(model, cluster, cfg), links,
                           cfg.microbatches(model))
    now = float(latency.step_s(slots))
    best = search(latency, seed=seed, start=slots)
    return {"config": cfg.label(), "current_step_s": round(now, 6),
            "replaced_step_s": round(best.step_s, 6),
            "faster_pct": round(100 * (now / best.step_s - 1), 2),
            "current_slow_links_used": slow_links_used(cfg, slots, links),
            "replaced_slow_links_used": slow_links_used(cfg, best.slots, links),
            "replaced_placement": placement_json(cfg, best.slots, cluster.gpus_per_host)}


def _as_json(result: Any, job: Any, whatif: dict[str, Any] | None) -> dict[str, Any]:
    from trainscope.plan.recommend import candidate_json

    out: dict[str, Any] = {
        "cluster": {"hosts": result.cluster.hosts, "gpus_per_host": result.cluster.gpus_per_host,
                    "gpu_memory_gib": result.cluster.gpu_memory_gib},
        "recommendations": [candidate_json(c, result.model, result.cluster)
                            for c in result.ranked],
        "uniform_links_choice": None,
        "rejected": [{"config": r.cfg.label(), "reason": r.reason} for r in result.rejected],
    }
    u = result.uniform_choice
    if u is not None:
        out["uniform_links_choice"] = {"config": u.cfg.label(),
                                       "uniform_links_step_s": round(u.uniform_step_s, 6),
                                       "measured_links_step_s": round(u.default_step_s, 6)}
    if job is not None:
        out["measured"] = job.as_json()
        out["measured"]["coverage"] = job.coverage_lines()
        out["job_whatif"] = whatif
    return out


def _print(result: Any, job: Any, whatif: dict[str, Any] | None, show_rejected: bool) -> None:
    cluster = result.cluster
    echo = click.echo
    echo(f"Cluster: {cluster.hosts} hosts × {cluster.gpus_per_host} GPUs, "
         f"{cluster.gpu_memory_gib:g} GiB each")
    if job is not None:
        echo(f"Links measured by job {job.job_id}:")
        for line in job.coverage_lines():
            echo(f"  {line}")
    if not result.ranked:
        echo("No configuration fits (see the rejected list below).")
    else:
        echo("")
        echo(f"{'#':>2}  {'configuration':18} {'step':>8} {'default':>8} {'memory':>9} "
             f"{'headroom':>9}  why")
        for i, c in enumerate(result.ranked, 1):
            echo(f"{i:>2}  {c.cfg.label():18} {c.step_s:7.3f}s {c.default_step_s:7.3f}s "
                 f"{c.memory.total_bytes / GIB:6.1f}GiB {c.headroom_gib(cluster):6.1f}GiB  "
                 f"{c.reason}")
        echo("   (step: searched placement; default: Megatron's rank order on the same links;"
             " memory: worst stage)")
        _print_placement(result.ranked[0], cluster.gpus_per_host)
    u = result.uniform_choice
    if u is not None and result.ranked:
        best = result.ranked[0]
        echo(f"\nA planner assuming uniform links would run {u.cfg.label()} (default placement): "
             f"{u.uniform_step_s:.3f} s by its model, {u.default_step_s:.3f} s on these links; "
             f"the recommendation is {u.default_step_s / best.step_s:.2f}× faster.")
    if whatif is not None:
        if "error" in whatif:
            echo(f"\nThis job ({whatif['config']}): {whatif['error']}")
        else:
            echo(f"\nThis job ({whatif['config']}), re-placed, would run "
                 f"{whatif['faster_pct']:.1f}% faster: {whatif['current_step_s']:.3f} s → "
                 f"{whatif['replaced_step_s']:.3f} s per step (model).")
            for used in whatif["current_slow_links_used"]:
                still = used in whatif["replaced_slow_links_used"]
                echo(f"  its placement sends {' and '.join(used['traffic'])} traffic over "
                     f"{used['link']}" + ("; re-placed, it still does (the search found no faster "
                                         "placement that avoids it)" if still else
                                         "; re-placed, it does not"))
    if result.rejected:
        memory = sum(1 for r in result.rejected if "GiB" in r.reason)
        echo(f"\n{len(result.rejected)} configuration(s) left out ({memory} do not fit in "
             f"memory){'' if show_rejected else '; --show-rejected lists them'}.")
        if show_rejected:
            for r in result.rejected:
                echo(f"  {r.cfg.label():18} {r.reason}")


def _print_placement(c: Any, per_host: int) -> None:
    from trainscope.plan.latency import group_gpus

    gpus = group_gpus(c.slots, c.cfg.tp)
    by_host: dict[int, list[str]] = {}
    for d in range(c.cfg.dp):
        for s in range(c.cfg.pp):
            g = int(gpus[d, s, 0])
            by_host.setdefault(g // per_host, []).append((g % per_host, f"d{d}s{s}"))  # type: ignore[arg-type]
    click.echo(f"\nPlacement of #1 (per host: GPU→replica d, stage s; tp {c.cfg.tp} GPUs each):")
    for host in sorted(by_host):
        cells = " ".join(f"{local}:{name}" for local, name in sorted(by_host[host]))  # type: ignore[misc]
        click.echo(f"  host {host}: {cells}")
