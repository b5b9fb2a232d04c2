"""A simulated training cluster: what real producers would send about a DP × PP × TP job.

Each step runs a 1F1B pipeline schedule per stage: forward/backward compute per micro-batch,
a tensor-parallel all-reduce after each compute op, pipeline send/recv between stages, then the
data-parallel gradient all-reduce and the optimizer. Synchronisation is modelled, not painted on:
a collective ends only when its slowest member arrives (plus the transfer), a receive ends when
the sender's data arrives, so one slow rank makes its peers wait — and the waiting shows up in
*their* collective time, exactly as in real jobs. All ranks of one stage are simulated together
as (dp, tp) numpy arrays.

Faults (:mod:`.faults`) change only the physics (compute speed, clocks, link bandwidth, stalls,
token counts); what the detectors see is the function summaries, step records and metric samples
a real producer sends — the simulator never labels a culprit. Like ``attach()`` in each real rank,
each simulated rank condenses its spans per window into summaries (:mod:`.summaries`); raw span
batches are sent instead only when asked for (``ClusterSpec.send="spans"``), for comparison.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np

from trainscope.producers.simulate.faults import Fault
from trainscope.producers.simulate.layout import Layout
from trainscope.producers.simulate.records import (
    OpRecorder,
    SpanEmitter,
    step_records,
)
from trainscope.producers.simulate.summaries import RankRecorders
from trainscope.schemas import metrics as m
from trainscope.schemas.records import (
    SPAN_COLUMNS,
    MetricSample,
    Record,
    SpanBatch,
    StepRecord,
    SummaryBatch,
)

if TYPE_CHECKING:
    import pandas as pd

_MS = 1e6

NOMINAL_SM_CLOCK_MHZ = 1980.0
NOMINAL_NIC_BYTES_PER_S = 25e9
NOMINAL_PCIE_BYTES_PER_S = 14e9
# NVML clocks-event reasons: SW thermal slowdown | HW thermal slowdown.
_THERMAL_THROTTLE_BITS = 0x20 | 0x40
# SW power cap: on an H100 every reading of a GPU that computes at least half of each 400 ms step
# carries it (benchmarks/gpu_throttle_duty.py; with 5 s steps, 56-60% of the readings at half).
_POWER_CAP_BIT = 0x04
_POWER_CAPPED_UTIL_PCT = 50.0


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
    # What each rank sends about its functions: per-window summaries, as every real producer
    # does, or the raw span events (to compare the two paths).
    send: Literal["summaries", "spans"] = "summaries"
    # The window the ranks condense spans over: the stream job's window length.
    window_s: float = 15.0
    # Ranks whose host clock is off, as (rank, seconds ahead; negative: behind): every
    # timestamp such a rank sends (spans, summaries' windows, step records, metric samples) is
    # read off its wrong clock, while the physics (when its collectives end) stays true.
    clock_skew_s: tuple[tuple[int, float], ...] = ()
    # Whether step records carry token counts and sequence lengths (a script that does not
    # pass them to trainscope.step() sends none): without them, imbalance is seen from timing.
    send_tokens: bool = True

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
    # Raw span batches, one per host (ClusterSpec.send="spans" only).
    spans: list[SpanBatch] = field(default_factory=list)
    # Summaries of the windows the ranks closed during this step, one or more per rank and
    # window; the last step also carries every window still open (ClusterSpec.send="summaries").
    summaries: list[SummaryBatch] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    metrics: list[MetricSample] = field(default_factory=list)
    # Op-trace rows of this step (what-if trace columns) when ClusterSpec.record_ops is set.
    ops: pd.DataFrame | None = None
    # Span events the ranks measured in this step, sent raw or condensed.
    span_count: int = 0


def one_f_one_b(pp: int, stage: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B order of forward ('F') and backward ('B') micro-batch ops on one stage."""
    warmup = min(pp - stage - 1, microbatches)
    order = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(microbatches - warmup, microbatches)]
    return order


class SimulatedCluster:
    def __init__(self, spec: ClusterSpec, faults: list[Fault] | None = None) -> None:
        if spec.send not in ("summaries", "spans"):
            raise ValueError(f"send must be 'summaries' or 'spans', got {spec.send!r}")
        self.spec = spec
        self.layout = spec.layout
        self.faults = list(faults or [])
        for fault in self.faults:
            self._validate(fault)
        self._skew_ns = np.zeros(self.layout.world_size, dtype=np.int64)
        for rank, skew_s in spec.clock_skew_s:
            if not 0 <= rank < self.layout.world_size:
                raise ValueError(
                    f"clock skew names rank {rank} but the job has {self.layout.world_size} "
                    f"ranks (0..{self.layout.world_size - 1})"
                )
            self._skew_ns[rank] = round(skew_s * 1e9)
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
        spec = self.spec
        start = np.full(self.layout.world_size, float(spec.start_ns))
        recorders = (
            RankRecorders(spec.job_id, self.layout.world_size, spec.window_s)
            if spec.send == "summaries" else None
        )
        for step in range(spec.steps):
            output, start = self._step(step, start)
            if self._skew_ns.any():
                _read_off_clocks(output, self._skew_ns)
            if recorders is not None:
                recorders.steps_started(output.steps)
                recorders.add(output.spans)
                output.spans = []
                # Each rank's clock is where its step ended; the job ends after the last step.
                output.summaries = (
                    recorders.flush() if step == spec.steps - 1
                    else recorders.closed(start + self._skew_ns)
                )
            yield output

    def batches(self) -> Iterator[list[Record]]:
        """Records per step, the topology first: what a pipeline would receive."""
        first = True
        for output in self.run():
            records: list[Record] = list(self.topology_records()) if first else []
            first = False
            records += [*output.spans, *output.summaries, *output.steps, *output.metrics]
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
        """One training step of every rank from its ``start``: data loading and GC, the
        pipeline schedule, then the gradient all-reduce and the optimizer. Returns what the
        ranks send about it and when each rank's step ended."""
        spec, layout = self.spec, self.layout
        emit = SpanEmitter()
        ops = OpRecorder(spec.dp, spec.tp) if spec.record_ops else None
        compute = self._compute_factor(step)
        link = self._link_factor(step)
        tokens = self._tokens(step)
        busy = np.zeros(layout.world_size)  # compute time per rank, for utilisation
        ready = self._load_batches(emit, step, start)
        self._run_pipeline(emit, step, ready, compute, link, tokens / spec.tokens_per_microbatch,
                           busy, ops)
        end = self._finish_step(emit, ready, compute, link, busy, ops)
        emit.add("train_step", np.arange(layout.world_size), start, end - start)

        output = StepOutput(step=step)
        output.spans = emit.batches(spec.job_id, layout, step)
        output.span_count = sum(len(b) for b in output.spans)
        output.steps = step_records(
            spec.job_id, layout, spec.microbatches, step, start, end,
            tokens if spec.send_tokens else None, emit.collective_ns(layout.world_size),
        )
        output.metrics = self._metrics(step, start, end, busy, compute, link)
        if ops is not None:
            output.ops = ops.frame(step)
        return output, end

    def _load_batches(self, emit: SpanEmitter, step: int, start: np.ndarray) -> list[np.ndarray]:
        """Each stage's ranks load their batch, then may pause for GC (a routine collection
        now and then, and the injected pauses); returns when each stage's ranks are ready."""
        spec, layout = self.spec, self.layout
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
        return ready

    def _run_pipeline(
        self,
        emit: SpanEmitter,
        step: int,
        ready: list[np.ndarray],
        compute: np.ndarray,
        link: np.ndarray,
        token_factor: np.ndarray,
        busy: np.ndarray,
        ops: OpRecorder | None,
    ) -> None:
        """Every stage's 1F1B schedule, an op as soon as its input has arrived from the
        neighbouring stage; ``ready`` (per stage) advances as the ops run."""
        fwd_arrival: dict[tuple[int, int], np.ndarray] = {}
        bwd_arrival: dict[tuple[int, int], np.ndarray] = {}
        position = [0] * self.spec.pp
        remaining = sum(len(s) for s in self._schedules)
        while remaining:
            progressed = False
            for s in range(self.spec.pp):
                schedule = self._schedules[s]
                while position[s] < len(schedule):
                    kind, mb = schedule[position[s]]
                    forward = kind == "F"
                    src = s - 1 if forward else s + 1
                    arrivals = fwd_arrival if forward else bwd_arrival
                    if 0 <= src < self.spec.pp and (s, mb) not in arrivals:
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

    def _finish_step(
        self,
        emit: SpanEmitter,
        ready: list[np.ndarray],
        compute: np.ndarray,
        link: np.ndarray,
        busy: np.ndarray,
        ops: OpRecorder | None,
    ) -> np.ndarray:
        """The data-parallel gradient all-reduce (it ends when its slowest member arrives, plus
        the transfer) and the optimizer; returns when each rank's step ended."""
        spec = self.spec
        end = np.empty(self.layout.world_size)
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
        return end

    def _run_op(
        self,
        emit: SpanEmitter,
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
        ops: OpRecorder | None = None,
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
        # A GPU slowed by heat draws less power, so only the others run into the power cap.
        reasons = np.where((reasons == 0) & (util >= _POWER_CAPPED_UTIL_PCT), _POWER_CAP_BIT,
                           reasons)
        power = 250 + 450 * util / 100 * clock / NOMINAL_SM_CLOCK_MHZ + noise(0, 8, n)
        hot = reasons == _THERMAL_THROTTLE_BITS
        temperature = np.where(hot, 89.0, 60 + 15 * util / 100) + noise(0, 0.8, n)
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


def _read_off_clocks(output: StepOutput, skew_ns: np.ndarray) -> None:
    """Stamp ``output``'s spans, step records and metric samples with each rank's own clock,
    ``skew_ns`` ahead of the true one (before spans are condensed, as a producer condenses on
    its own clock)."""
    output.spans = [
        msgspec.structs.replace(
            batch, start_ns=(batch.column("start_ns") + skew_ns[batch.column("rank")])
            .astype(SPAN_COLUMNS["start_ns"]).tobytes(),
        )
        for batch in output.spans
    ]
    output.steps = [
        msgspec.structs.replace(r, start_ns=r.start_ns + int(skew_ns[r.rank])) if skew_ns[r.rank]
        else r
        for r in output.steps
    ]
    output.metrics = [
        msgspec.structs.replace(m, ts_ns=m.ts_ns + int(skew_ns[m.rank])) if skew_ns[m.rank] else m
        for m in output.metrics
    ]
