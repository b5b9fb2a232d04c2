"""The links a running job measured, read from the store.

Two kinds of measurement exist in trainscope's tables, and this module uses both for what they
honestly say:

- ``metric_samples`` ``nic_tx_bytes_per_s`` — each rank's achieved network throughput while its
  NIC was transferring: one figure per GPU, i.e. a *per-rank link factor*, not a per-pair
  bandwidth. It becomes that GPU's network cap (:attr:`Links.gpu_cap_bytes_per_s`), and its
  median over all ranks the nominal host-to-host bandwidth.
- ``function_summaries`` of ``pp_send`` — bytes over time of every pipeline send, per sending
  rank; with the job's topology the receiver is known (same dp and tp rank, next stage), so
  each is a real *pair* measurement. A pair across hosts that is clearly slower than both ends'
  own caps explain marks its host pair slow; pairs inside a host say nothing about the network.

Pairs that no job traffic crosses are never measured: they are assumed nominal, and the
coverage figures say how much was seen. Intra-host bandwidth is never measured here; it comes
from the plan file (``cluster.intra_host_gbit_per_s``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainscope.plan.spec import GBIT, ClusterSpec, Links, ModelSpec
from trainscope.plan.transformer import ParallelConfig, stage_forward_flops
from trainscope.schemas.errors import TrainscopeError
from trainscope.schemas.metrics import NIC_TX_BYTES_PER_S

# A measured pair slower than this share of what its two ends' caps allow marks the host pair.
PAIR_SLOW_SHARE = 0.8


class MeasuredError(LookupError, TrainscopeError):
    """The store has no usable measurements of the job; the text says what is missing."""


@dataclass(frozen=True)
class Measured:
    value_bytes_per_s: float
    samples: int
    newest_ns: int


@dataclass
class JobLinks:
    job_id: str
    dp: int
    pp: int
    tp: int
    hosts: list[str]  # sorted host names: host index i is hosts[i]
    gpus_per_host: int
    gpu_of_rank: np.ndarray  # (world,) global GPU index of each rank
    coords: np.ndarray  # (world, 3) dp_rank, pp_stage, tp_rank
    nic: dict[int, Measured] = field(default_factory=dict)  # by rank
    pairs: dict[tuple[int, int], Measured] = field(default_factory=dict)  # (src, dst) ranks
    # Mean forward and backward time of one call, per rank (function summaries).
    forward_s: dict[int, float] = field(default_factory=dict)
    backward_s: dict[int, float] = field(default_factory=dict)
    now_ns: int = 0

    @property
    def world(self) -> int:
        return len(self.gpu_of_rank)

    def nominal_bytes_per_s(self) -> float:
        return float(np.median([m.value_bytes_per_s for m in self.nic.values()]))

    def cluster(self, base: ClusterSpec) -> ClusterSpec:
        """The plan file's cluster with this job's hosts, GPUs and nominal bandwidth."""
        import msgspec

        return msgspec.structs.replace(
            base, hosts=len(self.hosts), gpus_per_host=self.gpus_per_host,
            inter_host_gbit_per_s=self.nominal_bytes_per_s() / GBIT, links=(), gpu_links=(),
        )

    def links(self, cluster: ClusterSpec) -> Links:
        links = Links.uniform(cluster)
        for rank, m in self.nic.items():
            links.gpu_cap_bytes_per_s[self.gpu_of_rank[rank]] = m.value_bytes_per_s
        per_host = self.gpus_per_host
        for (src, dst), m in self.pairs.items():
            a, b = self.gpu_of_rank[src], self.gpu_of_rank[dst]
            ha, hb = a // per_host, b // per_host
            if ha == hb:
                continue
            explained = min(links.gpu_cap_bytes_per_s[a], links.gpu_cap_bytes_per_s[b],
                            links.host_bytes_per_s[ha, hb])
            if m.value_bytes_per_s < PAIR_SLOW_SHARE * explained:
                links.host_bytes_per_s[ha, hb] = links.host_bytes_per_s[hb, ha] = (
                    m.value_bytes_per_s)
        return links

    def calibrate(self, model: ModelSpec, cluster: ClusterSpec,
                  micro_batch: int) -> tuple[ClusterSpec, dict[str, Any]]:
        """``mfu`` and ``backward_over_forward`` from the job's measured compute times.

        One forward call is one micro-batch of one stage; the model file must describe the job's
        own model at its micro-batch size, or the figures mean nothing. The median over stages
        of (FLOPs of a stage's forward per GPU) ÷ (measured time × peak) gives the achieved
        share of the peak."""
        import msgspec

        if not self.forward_s:
            raise MeasuredError(f"job {self.job_id!r}: no forward/backward summaries to "
                                "calibrate compute times with")
        cfg = self.config(micro_batch)
        problem = cfg.problem(model, cluster.gpus_per_host)
        if problem:
            raise MeasuredError(f"job {self.job_id!r} ({cfg.label()}): the model file does not "
                                f"fit the job's configuration: {problem}")
        flops = np.asarray(stage_forward_flops(model, cfg)) / cfg.tp
        shares, ratios = [], []
        for s in range(self.pp):
            ranks = [r for r in np.flatnonzero(self.coords[:, 1] == s) if r in self.forward_s]
            if not ranks:
                continue
            fwd = float(np.median([self.forward_s[r] for r in ranks]))
            shares.append(flops[s] / (fwd * cluster.peak_tflops * 1e12))
            ratios.extend(self.backward_s[r] / self.forward_s[r] for r in ranks
                          if r in self.backward_s)
        mfu = float(np.median(shares))
        if not 0 < mfu <= 1:
            raise MeasuredError(
                f"job {self.job_id!r}: its forward times imply {mfu:.2f} of the GPU's peak; "
                "does the model file describe this job's model and micro-batch?")
        ratio = float(np.median(ratios)) if ratios else cluster.backward_over_forward
        if model.recompute:
            ratio -= 1.0  # the measured backward includes the recomputed forward
        calibrated = msgspec.structs.replace(cluster, mfu=mfu, backward_over_forward=ratio)
        info = {"ranks": len(self.forward_s), "stages": len(shares), "mfu": round(mfu, 4),
                "file_mfu": cluster.mfu, "backward_over_forward": round(ratio, 3),
                "forward_ms_median": round(1e3 * float(np.median(list(self.forward_s.values()))),
                                           3)}
        return calibrated, info

    def config(self, micro_batch: int) -> ParallelConfig:
        return ParallelConfig(self.dp, self.pp, self.tp, micro_batch)

    def current_slots(self) -> np.ndarray | None:
        """The job's own placement as slots, or None when its tp groups are not whole slots."""
        slots = np.empty((self.dp, self.pp), dtype=np.int64)
        for d in range(self.dp):
            for s in range(self.pp):
                mine = np.flatnonzero((self.coords[:, 0] == d) & (self.coords[:, 1] == s))
                gpus = self.gpu_of_rank[mine[np.argsort(self.coords[mine, 2])]]
                if gpus[0] % self.tp or list(gpus) != list(range(gpus[0], gpus[0] + self.tp)):
                    return None
                slots[d, s] = gpus[0] // self.tp
        return slots

    def coverage_lines(self) -> list[str]:
        lines = []
        if self.nic:
            ages = [max(0.0, (self.now_ns - m.newest_ns) / 1e9) for m in self.nic.values()]
            samples = [m.samples for m in self.nic.values()]
            lines.append(
                f"NIC throughput ({NIC_TX_BYTES_PER_S}): {len(self.nic)}/{self.world} ranks, "
                f"{min(samples)}–{max(samples)} samples each, newest {_age(min(ages))} old, "
                f"stalest rank {_age(max(ages))} old; "
                f"median {self.nominal_bytes_per_s() / GBIT:.0f} Gb/s"
            )
            slow = sorted((m.value_bytes_per_s, r) for r, m in self.nic.items()
                          if m.value_bytes_per_s < 0.75 * self.nominal_bytes_per_s())
            for value, rank in slow:
                g = int(self.gpu_of_rank[rank])
                lines.append(f"  slow: rank {rank} ({self.hosts[g // self.gpus_per_host]} GPU "
                             f"{g % self.gpus_per_host}) {value / GBIT:.0f} Gb/s")
        else:
            lines.append(f"NIC throughput ({NIC_TX_BYTES_PER_S}): none")
        expected = self.dp * (self.pp - 1) * self.tp
        if self.pairs:
            ages = [max(0.0, (self.now_ns - m.newest_ns) / 1e9) for m in self.pairs.values()]
            lines.append(
                f"pipeline sends (pp_send bytes/time): {len(self.pairs)}/{expected} rank pairs "
                f"(only the first and last stages' sends have one peer), newest "
                f"{_age(min(ages))} old, stalest {_age(max(ages))} old"
            )
        else:
            lines.append(f"pipeline sends (pp_send bytes/time): 0/{expected} rank pairs")
        lines.append("other GPU pairs: not measured by this job, assumed at the median")
        return lines

    def as_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "ranks": self.world,
            "hosts": self.hosts,
            "nic_ranks": len(self.nic),
            "pair_measurements": len(self.pairs),
            "nominal_gbit_per_s": round(self.nominal_bytes_per_s() / GBIT, 3) if self.nic else None,
            "nic": {str(r): {"gbit_per_s": round(m.value_bytes_per_s / GBIT, 3),
                             "samples": m.samples,
                             "age_s": round(max(0.0, (self.now_ns - m.newest_ns) / 1e9), 1)}
                    for r, m in sorted(self.nic.items())},
        }


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def read_job_links(client: Any, job_id: str, *, now_ns: int | None = None) -> JobLinks:
    """What the store holds about ``job_id``'s links: its topology and GPU placement, each
    rank's NIC throughput, the pipeline sends that are clean pair measurements, and each rank's
    forward and backward time. MeasuredError when there is nothing to plan with."""
    dp, pp, tp, host_of, coords = _topology(client, job_id)
    names, gpus_per_host, gpu_of_rank = _gpu_placement(client, job_id, host_of)
    result = JobLinks(job_id, dp, pp, tp, names, gpus_per_host, gpu_of_rank, coords,
                      now_ns=now_ns if now_ns is not None else time.time_ns())
    _read_nic(client, result)
    _read_pipeline_pairs(client, result)
    _read_compute_times(client, result)
    if not result.nic and not result.pairs:
        raise MeasuredError(
            f"job {job_id!r}: the store has no link measurements ({NIC_TX_BYTES_PER_S} "
            "metric samples or pp_send summaries with bytes)")
    if not result.nic:
        raise MeasuredError(
            f"job {job_id!r}: no {NIC_TX_BYTES_PER_S} samples; pipeline-send pairs alone do "
            "not give a nominal bandwidth to plan with")
    return result


def _topology(client: Any, job_id: str) -> tuple[int, int, int, list[str], np.ndarray]:
    """(dp, pp, tp, host of each rank, (dp_rank, pp_stage, tp_rank) of each rank) from the
    job's latest topology, ranks in order."""
    topo = client.query(
        "SELECT dp_size, pp_size, tp_size, cp_size, ranks, hosts, dp_ranks, pp_stages, tp_ranks "
        "FROM topologies WHERE job_id = {job:String}",
        parameters={"job": job_id},
    ).result_rows
    if not topo:
        raise MeasuredError(f"job {job_id!r}: no topology in the store (is the job id right?)")
    dp, pp, tp, cp, ranks, hosts, dps, pps, tps = topo[-1]
    if cp != 1:
        raise MeasuredError(f"job {job_id!r}: context parallelism (cp {cp}) is not planned yet")
    world = len(ranks)
    order = np.argsort(ranks)
    ranks_a = np.asarray(ranks)[order]
    if list(ranks_a) != list(range(world)):
        raise MeasuredError(f"job {job_id!r}: topology ranks are not 0..{world - 1}")
    host_of = [hosts[i] for i in order]
    coords = np.stack([np.asarray(dps)[order], np.asarray(pps)[order],
                       np.asarray(tps)[order]], axis=1)
    return int(dp), int(pp), int(tp), host_of, coords


def _gpu_placement(
    client: Any, job_id: str, host_of: list[str]
) -> tuple[list[str], int, np.ndarray]:
    """(sorted host names, GPUs per host, global GPU index of each rank): a rank's GPU is the
    device its metric samples name, else its position among its host's ranks."""
    device: dict[int, int] = {}
    for rank, dev in client.query(
        "SELECT rank, any(device) FROM metric_samples WHERE job_id = {job:String} "
        "AND rank >= 0 AND device >= 0 GROUP BY rank",
        parameters={"job": job_id},
    ).result_rows:
        device[int(rank)] = int(dev)
    world = len(host_of)
    names = sorted(set(host_of))
    per_host: dict[str, list[int]] = {}
    for r in range(world):
        per_host.setdefault(host_of[r], []).append(r)
    gpus_per_host = max(len(v) for v in per_host.values())
    gpus_per_host = max(gpus_per_host, max(device.values(), default=-1) + 1)
    gpu_of_rank = np.empty(world, dtype=np.int64)
    for host, members in per_host.items():
        for k, r in enumerate(members):
            local = device.get(r, k)
            gpu_of_rank[r] = names.index(host) * gpus_per_host + local
    if len(set(gpu_of_rank.tolist())) != world:
        raise MeasuredError(f"job {job_id!r}: two ranks claim the same GPU (metric devices)")
    return names, gpus_per_host, gpu_of_rank


def _read_nic(client: Any, links: JobLinks) -> None:
    """Each rank's median NIC throughput while transferring."""
    for rank, value, samples, newest in client.query(
        "SELECT rank, median(value), count(), max(ts_ns) FROM metric_samples "
        "WHERE job_id = {job:String} AND name = {name:String} AND rank >= 0 AND value > 0 "
        "GROUP BY rank",
        parameters={"job": links.job_id, "name": NIC_TX_BYTES_PER_S},
    ).result_rows:
        if 0 <= rank < links.world:
            links.nic[int(rank)] = Measured(float(value), int(samples), int(newest))


def _read_pipeline_pairs(client: Any, links: JobLinks) -> None:
    """Pipeline sends of ranks with one neighbouring stage, as (sender, receiver) pairs."""
    rank_of = {(int(d), int(s), int(t)): r for r, (d, s, t) in enumerate(links.coords)}
    for rank, bytes_total, total_ns, windows, newest in client.query(
        "SELECT rank, sum(bytes_total), sum(total_ns), count(), max(window_end_ns) "
        "FROM function_summaries WHERE job_id = {job:String} AND name = 'pp_send' "
        "AND bytes_total > 0 AND total_ns > 0 GROUP BY rank",
        parameters={"job": links.job_id},
    ).result_rows:
        if not 0 <= rank < links.world:
            continue
        d, s, t = (int(x) for x in links.coords[rank])
        # A stage sends forward to s + 1 and backward to s − 1; the summary mixes both, so
        # only the first and last stages (one neighbour each) give a clean pair.
        peers = [rank_of.get((d, n, t)) for n in (s - 1, s + 1) if 0 <= n < links.pp]
        if len(peers) != 1 or peers[0] is None:
            continue
        links.pairs[(int(rank), peers[0])] = Measured(
            float(bytes_total) / (float(total_ns) / 1e9), int(windows), int(newest))


def _read_compute_times(client: Any, links: JobLinks) -> None:
    """Each rank's mean time of one forward and one backward call."""
    for rank, name, total_ns, calls in client.query(
        "SELECT rank, name, sum(total_ns), sum(count) FROM function_summaries "
        "WHERE job_id = {job:String} AND name IN ('forward', 'backward') AND count > 0 "
        "GROUP BY rank, name",
        parameters={"job": links.job_id},
    ).result_rows:
        if 0 <= rank < links.world:
            into = links.forward_s if name == "forward" else links.backward_s
            into[int(rank)] = float(total_ns) / 1e9 / float(calls)
