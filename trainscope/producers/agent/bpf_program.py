"""The BPF program of the eBPF collector (compiled by bcc at run time) and its function table.

Everything is aggregated in the kernel: per (process, function) a count, total/min/max latency,
bytes moved and a log2 latency histogram. User space reads the maps once per interval, so the
agent's cost does not grow with the call rate of the traced process.

Two generations of aggregation maps (``*_0`` and ``*_1``) let user space read a quiescent set:
the collector flips ``generation[0]``, and after a short grace period drains the other
generation with one lookup-and-delete batch; probes that raced with the flip land in the new
generation, so no event is lost or counted twice.

Histogram slot ``s`` holds latencies in ``[2**s, 2**(s+1))`` ns (slot 0 also holds 0 ns).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscope.schemas.metrics import RUNQUEUE_WAIT, SCHED_LAYER


@dataclass(frozen=True)
class Probe:
    """One traced function: its symbol, library family and summary layer."""

    name: str
    library: str  # "cudart" or "nccl": the library family that exports the symbol
    layer: str
    # How to compute bytes moved at entry: (count argument, datatype argument) positions,
    # 1-based; count_arg 0 means "moves no bytes", dtype_arg 0 means "count is in bytes".
    count_arg: int = 0
    dtype_arg: int = 0


PROBES: tuple[Probe, ...] = (
    Probe("cudaLaunchKernel", "cudart", "cuda_api"),
    Probe("cudaMemcpy", "cudart", "cuda_api", count_arg=3),
    Probe("cudaMemcpyAsync", "cudart", "cuda_api", count_arg=3),
    Probe("cudaMemset", "cudart", "cuda_api", count_arg=3),
    Probe("cudaStreamSynchronize", "cudart", "cuda_api"),
    Probe("cudaDeviceSynchronize", "cudart", "cuda_api"),
    # NCCL calls only enqueue work on a stream: their latency is the host-side enqueue time
    # (which grows when the communicator blocks), not the collective's duration on the GPU.
    Probe("ncclAllReduce", "nccl", "collective", count_arg=3, dtype_arg=4),
    Probe("ncclAllGather", "nccl", "collective", count_arg=3, dtype_arg=4),
    Probe("ncclReduceScatter", "nccl", "collective", count_arg=3, dtype_arg=4),
    Probe("ncclBroadcast", "nccl", "collective", count_arg=3, dtype_arg=4),
    Probe("ncclSend", "nccl", "collective", count_arg=2, dtype_arg=3),
    Probe("ncclRecv", "nccl", "collective", count_arg=2, dtype_arg=3),
)

# Scheduler pseudo-functions (layer SCHED_LAYER), indices after the probes.
SCHED_OFF_CPU = "off_cpu"  # blocked: sleeping, waiting for I/O, a lock or the GPU driver
SCHED_RUNQUEUE = RUNQUEUE_WAIT  # runnable but preempted: waiting for a CPU (contention)
SCHED_FUNCTIONS = (SCHED_OFF_CPU, SCHED_RUNQUEUE)

HIST_SLOTS = 64


def function_table() -> list[tuple[str, str]]:
    """(layer, name) per function index used in the BPF maps."""
    return [(p.layer, p.name) for p in PROBES] + [(SCHED_LAYER, n) for n in SCHED_FUNCTIONS]


_HEADER = r"""
#include <uapi/linux/ptrace.h>

struct agg_key_t { u32 tgid; u32 fn; };
struct agg_val_t { u64 count; u64 total_ns; u64 min_ns; u64 max_ns; u64 bytes; };
struct hist_key_t { u32 tgid; u32 fn; u32 slot; };
struct start_key_t { u32 tid; u32 fn; };
struct start_val_t { u64 ts_ns; u64 bytes; };
struct off_val_t { u64 ts_ns; u32 tgid; u32 runnable; };

BPF_ARRAY(generation, u32, 1);
BPF_ARRAY(dropped, u64, 1);  /* events not aggregated because a map was full */
BPF_HASH(tracked, u32, u8, MAX_PROCS);
BPF_HASH(agg_0, struct agg_key_t, struct agg_val_t, MAX_AGG);
BPF_HASH(agg_1, struct agg_key_t, struct agg_val_t, MAX_AGG);
BPF_HASH(hist_0, struct hist_key_t, u64, MAX_HIST);
BPF_HASH(hist_1, struct hist_key_t, u64, MAX_HIST);
/* LRU: an entry whose return never comes (thread killed mid-call) ages out instead of
   filling the map. */
BPF_TABLE("lru_hash", struct start_key_t, struct start_val_t, starts, MAX_INFLIGHT);
BPF_TABLE("lru_hash", u32, struct off_val_t, offcpu, MAX_INFLIGHT);

static __always_inline u32 hist_slot(u64 delta_ns) {
    u32 slot = bpf_log2l(delta_ns);  /* floor(log2(v)) + 1 for v >= 1 */
    slot = slot > 0 ? slot - 1 : 0;
    return slot < HIST_SLOTS ? slot : HIST_SLOTS - 1;
}

RECORD_FUNCTIONS

static __always_inline void record(u32 tgid, u32 fn, u64 delta_ns, u64 bytes) {
    u32 zero_idx = 0;
    u32 *gen = generation.lookup(&zero_idx);
    struct agg_key_t key = {.tgid = tgid, .fn = fn};
    if (gen && *gen)
        record_1(&key, delta_ns, bytes);
    else
        record_0(&key, delta_ns, bytes);
}

static __always_inline u64 nccl_type_size(u64 dtype) {
    switch (dtype) {
    case 0: case 1: case 10: case 11: return 1;   /* int8, uint8, fp8 e4m3/e5m2 */
    case 6: case 9: return 2;                     /* float16, bfloat16 */
    case 2: case 3: case 7: return 4;             /* int32, uint32, float32 */
    case 4: case 5: case 8: return 8;             /* int64, uint64, float64 */
    default: return 0;
    }
}

static __always_inline int on_entry(u32 fn, u64 bytes) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!tracked.lookup(&tgid))
        return 0;
    struct start_key_t key = {.tid = (u32)id, .fn = fn};
    struct start_val_t val = {.ts_ns = bpf_ktime_get_ns(), .bytes = bytes};
    starts.update(&key, &val);
    return 0;
}

static __always_inline int on_return(u32 fn) {
    u64 id = bpf_get_current_pid_tgid();
    struct start_key_t key = {.tid = (u32)id, .fn = fn};
    struct start_val_t *start = starts.lookup(&key);
    if (!start)
        return 0;
    u64 delta_ns = bpf_ktime_get_ns() - start->ts_ns;
    u64 bytes = start->bytes;
    starts.delete(&key);
    record(id >> 32, fn, delta_ns, bytes);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    u32 prev_tgid = bpf_get_current_pid_tgid() >> 32;
    if (tracked.lookup(&prev_tgid)) {
        u32 prev_tid = args->prev_pid;
        /* (state & 0xff) == 0: TASK_RUNNING or preempted (TASK_REPORT_MAX) -> runnable */
        struct off_val_t off = {.ts_ns = now, .tgid = prev_tgid,
                                .runnable = (args->prev_state & 0xff) == 0};
        offcpu.update(&prev_tid, &off);
    }
    u32 next_tid = args->next_pid;
    struct off_val_t *off = offcpu.lookup(&next_tid);
    if (off) {
        u64 delta_ns = now - off->ts_ns;
        u32 tgid = off->tgid;
        u32 fn = off->runnable ? FN_RUNQUEUE : FN_OFF_CPU;
        offcpu.delete(&next_tid);
        record(tgid, fn, delta_ns, 0);
    }
    return 0;
}
"""


# bcc rewrites map calls only in plain code (not inside C macros), so the per-generation
# recording function is stamped out here once per generation.
_RECORD = r"""
static __always_inline void record_GEN(struct agg_key_t *key, u64 delta_ns, u64 bytes) {
    struct agg_val_t zero = {};
    zero.min_ns = (u64)-1;
    struct agg_val_t *v = agg_GEN.lookup_or_try_init(key, &zero);
    if (v) {
        __sync_fetch_and_add(&v->count, 1);
        __sync_fetch_and_add(&v->total_ns, delta_ns);
        __sync_fetch_and_add(&v->bytes, bytes);
        /* min/max are not atomic: concurrent calls of one function may lose an extreme */
        if (delta_ns < v->min_ns) v->min_ns = delta_ns;
        if (delta_ns > v->max_ns) v->max_ns = delta_ns;
    } else {
        u32 zero_idx = 0;
        dropped.atomic_increment(zero_idx);
    }
    struct hist_key_t hk = {.tgid = key->tgid, .fn = key->fn, .slot = hist_slot(delta_ns)};
    hist_GEN.atomic_increment(hk);
}
"""


def _bytes_expr(probe: Probe) -> str:
    if not probe.count_arg:
        return "0"
    count = f"(u64)PT_REGS_PARM{probe.count_arg}(ctx)"
    if not probe.dtype_arg:
        return count
    return f"{count} * nccl_type_size((u64)PT_REGS_PARM{probe.dtype_arg}(ctx))"


def render(
    *,
    max_procs: int = 1024,
    max_agg: int = 16384,
    max_hist: int = 65536,
    max_inflight: int = 65536,
) -> str:
    """The C text bcc compiles: the shared header plus one entry/return pair per probe."""
    defines = {
        "MAX_PROCS": max_procs,
        "MAX_AGG": max_agg,
        "MAX_HIST": max_hist,
        "MAX_INFLIGHT": max_inflight,
        "HIST_SLOTS": HIST_SLOTS,
        "FN_OFF_CPU": len(PROBES) + SCHED_FUNCTIONS.index(SCHED_OFF_CPU),
        "FN_RUNQUEUE": len(PROBES) + SCHED_FUNCTIONS.index(SCHED_RUNQUEUE),
    }
    parts = [f"#define {k} {v}" for k, v in defines.items()]
    records = "\n".join(_RECORD.replace("GEN", str(g)) for g in (0, 1))
    parts.append(_HEADER.replace("RECORD_FUNCTIONS", records))
    for index, probe in enumerate(PROBES):
        parts.append(
            f"int entry_{index}(struct pt_regs *ctx) {{ return on_entry({index}, "
            f"{_bytes_expr(probe)}); }}\n"
            f"int return_{index}(struct pt_regs *ctx) {{ return on_return({index}); }}"
        )
    return "\n".join(parts)
