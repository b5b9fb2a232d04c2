"""A simulated training cluster: what real producers would send about a DP × PP × TP job.

Each step runs a 1F1B pipeline schedule per stage: forward/backward compute per micro-batch,
a tensor-parallel all-reduce after each compute op, pipeline send/recv between stages, then the
data-parallel gradient all-reduce and the optimizer. Synchronisation is modelled, not painted on:
a collective ends only when its slowest member arrives (plus the transfer), a receive ends when
the sender's data arrives, so one slow rank makes its peers wait — and the waiting shows up in
*their* collective time, exactly as in real jobs. All ranks of one stage are simulated together
as (dp, tp) numpy arrays.

Faults (:mod:`.faults`) change only the physics (compute speed, clocks, link bandwidth, stalls,
token counts); what the detectors see is the spans, step records and metric samples a real
producer could send — the simulator never labels a culprit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from trainscope.producers.simulate.faults import Fault
from trainscope.producers.simulate.layout import Layout
from trainscope.schemas import metrics as m
from trainscope.schemas.records import MetricSample, Record, SpanBatch, StepRecord
from trainscope.whatif.optypes import CODE as OPTYPE_CODE
from trainscope.whatif.optypes import OPTYPES

if TYPE_CHECKING:
    import pandas as pd

FUNCTIONS: tuple[tuple[str, str], ...] = (
    ("step", "train_step"),
    ("dataloader", "next_batch"),
    ("gc", "gc.collect"),
    ("torch_op", "forward"),
    ("torch_op", "backward"),
    ("torch_op", "optimizer.step"),
    ("collective", "tp_all_reduce"),
    ("collective", "pp_send"),
    ("collective", "pp_recv"),
    ("collective", "dp_all_reduce"),
)
_FN = {name: i for i, (_, name) in enumerate(FUNCTIONS)}
_LAYERS = [layer for layer, _ in FUNCTIONS]
_NAMES = [name for _, name in FUNCTIONS]
_MS = 1e6

NOMINAL_SM_CLOCK_MHZ = 1980.0
NOMINAL_NIC_BYTES_PER_S = 25e9
NOMINAL_PCIE_BYTES_PER_S = 14e9
# NVML clocks-event reasons: SW thermal slowdown | HW thermal slowdown.
_THERMAL_THROTTLE_BITS = 0x20 | 0x40


@dataclass(frozen=True)
class ClusterSpec:
    job_id: str = "sim-job"
    dp: int = 2
    pp: int = 2
    tp: int = 2
    steps: int = 200
    microbatches: int = 8
    seed: int = 0
    start_ns: int = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z
    gpus_per_host: int = 8
    metric_interval_s: float = 5.0
    forward_ms: float = 24.0
    tokens_per_microbatch: int = 4096
    tp_allreduce_ms: float = 1.2
    activation_bytes: int = 32 * 2**20
    grad_bytes: int = 1 * 2**30
    optimizer_ms: float = 25.0
    dataloader_ms: float = 6.0
    healthy_gc_probability: float = 0.03
    jitter: float = 0.02
    # Also emit the Megatron-style op trace of every step (StepOutput.ops) for the what-if
    # analysis. Off by default: it costs a few array appends per op that nothing else needs.
    record_ops: bool = False

    @property
    def layout(self) -> Layout:
        return Layout(self.dp, self.pp, self.tp, self.gpus_per_host)

    def op_trace_meta(self) -> dict[str, int]:
        """Job metadata of the op trace (the what-if analysis' YAML)."""
        return {
            "dp_size": self.dp,
            "pp_size": self.pp,
            "tp_size": self.tp,
            "dsp_size": 1,
            "vpp_size": 1,
            "world_size": self.dp * self.pp * self.tp,
        }


@dataclass
class StepOutput:
    step: int
    spans: list[SpanBatch] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    metrics: list[MetricSample] = field(default_factory=list)
    # Op-trace rows of this step (what-if trace columns) when ClusterSpec.record_ops is set.
    ops: pd.DataFrame | None = None

    @property
    def span_count(self) -> int:
        return sum(len(b) for b in self.spans)


def one_f_one_b(pp: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of forward ('F') and backward ('B') micro-batch ops on one stage."""
    warmup = min(pp - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return order


class _Emitter:
    """Collects span columns of one step as arrays, one append per op for a whole stage."""

    def __init__(self) -> None:
        self.fn: list[np.ndarray] = []
        self.rank: list[np.ndarray] = []
        self.start: list[np.ndarray] = []
        self.duration: list[np.ndarray] = []
        self.bytes: list[np.ndarray] = []

    def add(
        self, fn: str, ranks: np.ndarray, start: np.ndarray, duration: np.ndarray, nbytes: int = 0
    ) -> None:
        ranks = ranks.ravel()
        if ranks.size == 0:
            return
        self.fn.append(np.full(ranks.size, _FN[fn], dtype=np.int32))
        self.rank.append(ranks)
        self.start.append(np.broadcast_to(start, duration.shape).ravel())
        self.duration.append(duration.ravel())
        self.bytes.append(np.full(ranks.size, nbytes, dtype=np.int64))


class _OpRecorder:
    """Op-trace rows of one step in the Megatron timer model, one append per op for all DP ranks
    of a stage.

    One worker is one (dp_rank, stage) pair seen from its tp_rank 0: the tensor-parallel peers
    are inside each op, so a compute op lasts until its TP all-reduce is done, as a Megatron
    timer around the layer's forward/backward records it.
    """

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.stage: list[int] = []
        self.code: list[int] = []
        self.seq: list[int] = []
        self.mb: list[int] = []
        self.start: list[np.ndarray] = []  # (dp,) ns each
        self.end: list[np.ndarray] = []
        self._next_seq: dict[tuple[int, int], int] = {}

    def add(
        self, optype: str, stage: int, start: np.ndarray, end: np.ndarray, mb: int = -1
    ) -> None:
        """``start``/``end``: (dp, tp) or (dp,) arrays of ns; only tp_rank 0 is kept."""
        code = OPTYPE_CODE[optype]
        # Ops of a stage are simulated in schedule order, which is each worker's start order.
        key = (stage, code)
        seq = self._next_seq.get(key, 0)
        self._next_seq[key] = seq + 1
        self.stage.append(stage)
        self.code.append(code)
        self.seq.append(seq)
        self.mb.append(mb)
        self.start.append(start[:, 0] if start.ndim == 2 else start)
        self.end.append(end[:, 0] if end.ndim == 2 else end)

    def frame(self, step: int) -> pd.DataFrame:
        import pandas as pd

        dp, tp = self.spec.dp, self.spec.tp
        n_ops = len(self.code)

        def per_op(values: list[int]) -> np.ndarray:
            return np.repeat(np.asarray(values, dtype=np.int32), dp)

        start = np.stack(self.start)
        stage = per_op(self.stage)
        dp_rank = np.tile(np.arange(dp, dtype=np.int32), n_ops)
        mb = per_op(self.mb)
        return pd.DataFrame(
            {
                "dp_rank": dp_rank,
                "stage": stage,
                "rank": (dp_rank.astype(np.int64) + dp * stage) * tp,  # tp_rank 0
                "step": np.full(n_ops * dp, step, dtype=np.int64),
                "optype": pd.Categorical.from_codes(per_op(self.code), list(OPTYPES)),
                "start_ts": start.ravel() / 1e9,
                # Subtract in ns first: seconds near the epoch keep only ~0.2 µs.
                "duration": (np.stack(self.end) - start).ravel() / 1e9,
                "seq_id": per_op(self.seq),
                "mc": np.zeros(n_ops * dp, dtype=np.int32),  # no virtual stages: vpp_size 1
                "gmc": stage,
                "mb_id": pd.arrays.IntegerArray(np.maximum(mb, 0), mb < 0),
            }
        )


class SimulatedCluster:
    def __init__(self, spec: ClusterSpec, faults: list[Fault] | None = None) -> None:
        self.spec = spec
        self.layout = spec.layout
        self.faults = list(faults or [])
        for fault in self.faults:
            self._validate(fault)
        self._rng = np.random.default_rng(spec.seed)
        n = self.layout.world_size
        # Chips are not identical: a persistent ±0.5% speed spread, as on real fleets.
        self._chip_speed = 1.0 + self._rng.normal(0.0, 0.005, n)
        self._schedules = [
            one_f_one_b(spec.pp, s, spec.microbatches) for s in range(spec.pp)
        ]
        self._grids = [self.layout.stage_grid(s) for s in range(spec.pp)]
        self._next_metric_ns = float(spec.start_ns)

    def _validate(self, fault: Fault) -> None:
        if "rank" in fault.params and fault["rank"] >= self.layout.world_size:
            raise ValueError(
                f"fault {fault} names rank {fault['rank']} but the job has "
                f"{self.layout.world_size} ranks (0..{self.layout.world_size - 1})"
            )
        if "stage" in fault.params and fault["stage"] >= self.spec.pp:
            raise ValueError(
                f"fault {fault} names stage {fault['stage']} but the job has {self.spec.pp} "
                f"pipeline stages (0..{self.spec.pp - 1})"
            )

    @property
    def span_count_per_step(self) -> int:
        return self.layout.world_size * (
            3 + 2 * self.spec.microbatches * (1 + (self.spec.tp > 1)) + 2
        )

    def topology_records(self) -> list[Record]:
        return [self.layout.topology(self.spec.job_id)]

    def run(self) -> Iterator[StepOutput]:
        """One StepOutput per training step, in order."""
        start = np.full(self.layout.world_size, float(self.spec.start_ns))
        for step in range(self.spec.steps):
            output, start = self._step(step, start)
            yield output

    def batches(self) -> Iterator[list[Record]]:
        """Records per step, the topology first: what a pipeline would receive."""
        first = True
        for output in self.run():
            records: list[Record] = list(self.topology_records()) if first else []
            first = False
            records += [*output.spans, *output.steps, *output.metrics]
            yield records

    # -- physics ----------------------------------------------------------------------------

    def _active(self, kind: str, step: int) -> list[Fault]:
        return [f for f in self.faults if f.kind == kind and f.active(step)]

    def _compute_factor(self, step: int) -> np.ndarray:
        factor = 1.0 / self._chip_speed
        for f in self._active("slow-gpu", step):
            factor[int(f["rank"])] *= f["factor"]
        for f in self._active("throttle", step):
            factor[int(f["rank"])] *= NOMINAL_SM_CLOCK_MHZ / f["mhz"]
        for f in self._active("stage-imbalance", step):
            factor[self._grids[int(f["stage"])].ravel()] *= f["factor"]
        return factor

    def _link_factor(self, step: int) -> np.ndarray:
        factor = np.ones(self.layout.world_size)
        for f in self._active("slow-link", step):
            factor[int(f["rank"])] *= f["factor"]
        return factor

    def _tokens(self, step: int) -> np.ndarray:
        """Tokens per (dp replica, micro-batch); TP and PP peers of a replica share its data."""
        spec = self.spec
        shape = (spec.dp, spec.microbatches)
        faults = self._active("seq-imbalance", step)
        if not faults:
            return np.full(shape, float(spec.tokens_per_microbatch))
        spread = faults[-1]["spread"]
        raw = self._rng.lognormal(0.0, spread, shape)
        return np.maximum(64.0, spec.tokens_per_microbatch * raw / np.exp(spread**2 / 2))

    def _jitter(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._rng.lognormal(0.0, self.spec.jitter, shape)

    def _step(self, step: int, start: np.ndarray) -> tuple[StepOutput, np.ndarray]:
        spec, layout = self.spec, self.layout
        emit = _Emitter()
        ops = _OpRecorder(spec) if spec.record_ops else None
        compute = self._compute_factor(step)
        link = self._link_factor(step)
        tokens = self._tokens(step)
        token_factor = tokens / spec.tokens_per_microbatch
        busy = np.zeros(layout.world_size)  # compute time per rank, for utilisation
        stall = np.zeros(layout.world_size)
        for f in self._active("dataloader-stall", step):
            stall[int(f["rank"])] += f["ms"] * _MS
        gc_extra = np.zeros(layout.world_size)
        for f in self._active("gc-pause", step):
            if (step - f.start) % int(f["every"]) == 0:
                gc_extra[int(f["rank"])] += f["ms"] * _MS

        ready: list[np.ndarray] = []
        for grid in self._grids:
            t = start[grid]
            loader = spec.dataloader_ms * _MS * self._jitter(grid.shape) + stall[grid]
            emit.add("next_batch", grid, t, loader)
            t = t + loader
            healthy_gc = self._rng.random(grid.shape) < spec.healthy_gc_probability
            gc = np.where(healthy_gc, self._rng.uniform(5, 25, grid.shape) * _MS, 0.0)
            gc = gc + gc_extra[grid]
            paused = gc > 0
            emit.add("gc.collect", grid[paused], t[paused], gc[paused])
            ready.append(t + gc)

        fwd_arrival: dict[tuple[int, int], np.ndarray] = {}
        bwd_arrival: dict[tuple[int, int], np.ndarray] = {}
        position = [0] * spec.pp
        remaining = sum(len(s) for s in self._schedules)
        while remaining:
            progressed = False
            for s in range(spec.pp):
                schedule = self._schedules[s]
                while position[s] < len(schedule):
                    kind, mb = schedule[position[s]]
                    forward = kind == "F"
                    src = s - 1 if forward else s + 1
                    arrivals = fwd_arrival if forward else bwd_arrival
                    if 0 <= src < spec.pp and (s, mb) not in arrivals:
                        break
                    ready[s] = self._run_op(
                        emit, s, mb, forward, ready[s], arrivals.pop((s, mb), None),
                        compute, link, token_factor, busy,
                        fwd_arrival if forward else bwd_arrival, ops,
                    )
                    position[s] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"pipeline schedule deadlocked at step {step}")

        end = np.empty(layout.world_size)
        for s, grid in enumerate(self._grids):
            t = ready[s]
            ring = link[grid].max(axis=0)  # a ring runs at its slowest link
            transfer = (
                2 * (spec.dp - 1) / spec.dp * spec.grad_bytes / NOMINAL_NIC_BYTES_PER_S * 1e9
            ) * ring * self._jitter((spec.tp,))
            done = t.max(axis=0) + transfer
            emit.add("dp_all_reduce", grid, t, np.broadcast_to(done, t.shape) - t, spec.grad_bytes)
            optimizer = spec.optimizer_ms * _MS * compute[grid] * self._jitter(grid.shape)
            emit.add("optimizer.step", grid, np.broadcast_to(done, t.shape), optimizer)
            if ops is not None:
                # Plain data-parallel gradient sync (no distributed optimizer): one all-reduce.
                done_all = np.broadcast_to(done, t.shape)
                ops.add("separate-grads-all-reduce", s, t, done_all)
                ops.add("optimizer", s, done_all, done_all + optimizer)
            busy[grid] += optimizer
            end[grid] = done + optimizer
        emit.add("train_step", np.arange(layout.world_size), start, end - start)

        output = StepOutput(step=step)
        output.spans = self._span_batches(emit, step)
        output.steps = self._step_records(step, start, end, tokens)
        output.metrics = self._metrics(step, start, end, busy, compute, link)
        if ops is not None:
            output.ops = ops.frame(step)
        return output, end

    def _run_op(
        self,
        emit: _Emitter,
        s: int,
        mb: int,
        forward: bool,
        t: np.ndarray,
        arrival: np.ndarray | None,
        compute: np.ndarray,
        link: np.ndarray,
        token_factor: np.ndarray,
        busy: np.ndarray,
        out_arrivals: dict[tuple[int, int], np.ndarray],
        ops: _OpRecorder | None = None,
    ) -> np.ndarray:
        spec = self.spec
        grid = self._grids[s]
        direction = "forward" if forward else "backward"
        if arrival is not None:
            got = np.maximum(t, arrival)
            emit.add("pp_recv", grid, t, got - t, spec.activation_bytes)
            if ops is not None:
                ops.add(f"{direction}-recv", s, t, got)
            t = got
        compute_start = t
        base = spec.forward_ms * _MS * (1.0 if forward else 2.0)
        duration = base * compute[grid] * token_factor[:, mb : mb + 1] * self._jitter(grid.shape)
        emit.add("forward" if forward else "backward", grid, t, duration)
        busy[grid] += duration
        t = t + duration
        if spec.tp > 1:
            # The TP all-reduce ends when the slowest TP peer has finished its compute.
            done = t.max(axis=1, keepdims=True) + spec.tp_allreduce_ms * _MS * self._jitter(
                (spec.dp, 1)
            )
            emit.add("tp_all_reduce", grid, t, np.broadcast_to(done, t.shape) - t)
            t = np.broadcast_to(done, t.shape).copy()
        if ops is not None:
            ops.add(f"{direction}-compute", s, compute_start, t, mb)
        dst = s + 1 if forward else s - 1
        if 0 <= dst < spec.pp:
            slowest = np.maximum(link[grid], link[self._grids[dst]])
            transfer = (
                spec.activation_bytes / NOMINAL_NIC_BYTES_PER_S * 1e9 * slowest
                * self._jitter(grid.shape)
            )
            emit.add("pp_send", grid, t, transfer, spec.activation_bytes)
            if ops is not None:
                ops.add(f"{direction}-send", s, t, t + transfer)
            t = t + transfer
            out_arrivals[(dst, mb)] = t
        return t

    # -- records ----------------------------------------------------------------------------

    def _span_batches(self, emit: _Emitter, step: int) -> list[SpanBatch]:
        rank = np.concatenate(emit.rank)
        host = rank // self.spec.gpus_per_host
        order = np.argsort(host, kind="stable")
        cols = {
            "rank": rank[order],
            "fn": np.concatenate(emit.fn)[order],
            "start_ns": np.rint(np.concatenate(emit.start)[order]).astype(np.int64),
            "duration_ns": np.rint(np.concatenate(emit.duration)[order]).astype(np.int64),
            "bytes_moved": np.concatenate(emit.bytes)[order],
        }
        bounds = np.flatnonzero(np.diff(host[order])) + 1
        batches = []
        for chunk in np.split(np.arange(len(order)), bounds):
            first_rank = int(cols["rank"][chunk[0]])
            batches.append(
                SpanBatch.from_arrays(
                    job_id=self.spec.job_id,
                    host=self.layout.host(first_rank),
                    layers=_LAYERS,
                    names=_NAMES,
                    step=np.full(len(chunk), step),
                    **{k: v[chunk] for k, v in cols.items()},
                )
            )
        return batches

    def _step_records(
        self, step: int, start: np.ndarray, end: np.ndarray, tokens: np.ndarray
    ) -> list[StepRecord]:
        spec = self.spec
        records = []
        for rank in range(self.layout.world_size):
            dp_rank = (rank // spec.tp) % spec.dp
            seq = tokens[dp_rank]
            records.append(
                StepRecord(
                    job_id=spec.job_id,
                    rank=rank,
                    step=step,
                    start_ns=int(start[rank]),
                    duration_ns=int(end[rank] - start[rank]),
                    samples=spec.microbatches,
                    tokens=int(seq.sum()),
                    seq_len_mean=float(seq.mean()),
                    seq_len_max=int(seq.max()),
                )
            )
        return records

    def _metrics(
        self,
        step: int,
        start: np.ndarray,
        end: np.ndarray,
        busy: np.ndarray,
        compute: np.ndarray,
        link: np.ndarray,
    ) -> list[MetricSample]:
        """NVML/NIC-style samples every ``metric_interval_s`` of simulated time."""
        if end.mean() < self._next_metric_ns:
            return []
        self._next_metric_ns = end.mean() + self.spec.metric_interval_s * 1e9
        n = self.layout.world_size
        noise = self._rng.normal
        clock = np.full(n, NOMINAL_SM_CLOCK_MHZ)
        reasons = np.zeros(n)
        for f in self._active("throttle", step):
            clock[int(f["rank"])] = f["mhz"]
            reasons[int(f["rank"])] = _THERMAL_THROTTLE_BITS
        clock = clock * (1 + noise(0, 0.003, n))
        util = np.clip(100.0 * busy / np.maximum(end - start, 1.0), 0, 100)
        power = 250 + 450 * util / 100 * clock / NOMINAL_SM_CLOCK_MHZ + noise(0, 8, n)
        temperature = np.where(reasons > 0, 89.0, 60 + 15 * util / 100) + noise(0, 0.8, n)
        nic = NOMINAL_NIC_BYTES_PER_S / link * (1 + noise(0, 0.02, n))
        pcie = NOMINAL_PCIE_BYTES_PER_S * (1 + noise(0, 0.02, n))
        values = {
            m.SM_CLOCK_MHZ: clock,
            m.SM_CLOCK_MAX_MHZ: np.full(n, NOMINAL_SM_CLOCK_MHZ),
            m.SM_UTIL_PCT: util,
            m.POWER_W: power,
            m.TEMPERATURE_C: temperature,
            m.THROTTLE_REASONS: reasons,
            m.NIC_TX_BYTES_PER_S: nic,
            m.PCIE_TX_BYTES_PER_S: pcie,
        }
        samples = []
        for rank in range(n):
            ts = int(end[rank])
            host = self.layout.host(rank)
            device = rank % self.spec.gpus_per_host
            for name, column in values.items():
                samples.append(
                    MetricSample(
                        job_id=self.spec.job_id,
                        host=host,
                        rank=rank,
                        device=device,
                        ts_ns=ts,
                        name=name,
                        value=float(column[rank]),
                    )
                )
        return samples
