"""Names of the metric samples producers publish (``MetricSample.name``).

One vocabulary for the NVML sampler, the simulated cluster and the detectors. Units are in the
names. Per-device GPU metrics carry ``device``; per-rank ones carry the rank when the producer
knows which rank owns the device.
"""

SM_CLOCK_MHZ = "sm_clock_mhz"
SM_CLOCK_MAX_MHZ = "sm_clock_max_mhz"
MEM_CLOCK_MHZ = "mem_clock_mhz"
SM_UTIL_PCT = "sm_util_pct"
MEM_UTIL_PCT = "mem_util_pct"
POWER_W = "power_w"
POWER_LIMIT_W = "power_limit_w"
TEMPERATURE_C = "temperature_c"
MEM_USED_BYTES = "mem_used_bytes"
MEM_TOTAL_BYTES = "mem_total_bytes"
# Bitmask of NVML clocks-event (throttle) reasons; decoded names live with the NVML sampler. A
# producer that condenses several readings into one sample ORs them (which reasons occurred).
THROTTLE_REASONS = "throttle_reasons"
# Share of the readings in a window (0..1) with a bit of THROTTLING_REASONS_MASK set.
THROTTLED_FRAC = "throttled_frac"
PCIE_TX_BYTES_PER_S = "pcie_tx_bytes_per_s"
PCIE_RX_BYTES_PER_S = "pcie_rx_bytes_per_s"
PCIE_REPLAY_COUNT = "pcie_replay_count"
NVLINK_TX_BYTES_PER_S = "nvlink_tx_bytes_per_s"
NVLINK_RX_BYTES_PER_S = "nvlink_rx_bytes_per_s"
# Achieved network throughput while the rank's NIC was transferring (not averaged over idle).
NIC_TX_BYTES_PER_S = "nic_tx_bytes_per_s"
NIC_RX_BYTES_PER_S = "nic_rx_bytes_per_s"
PROCESS_GPU_UTIL_PCT = "process_gpu_util_pct"
PROCESS_GPU_MEM_BYTES = "process_gpu_mem_bytes"
ECC_ERRORS = "ecc_errors"
XID_EVENTS = "xid_events"
# Cumulative NVLink CRC + replay + recovery error count of a device (all links).
NVLINK_ERROR_COUNT = "nvlink_error_count"
# Host-level counters of the agent (rank -1): CPU busy share over all cores, NIC bytes per second
# averaged over the interval (all non-loopback interfaces).
HOST_CPU_UTIL_PCT = "host_cpu_util_pct"
HOST_NET_TX_BYTES_PER_S = "host_net_tx_bytes_per_s"
HOST_NET_RX_BYTES_PER_S = "host_net_rx_bytes_per_s"
# A rank's progress, sent by its PyTorch producer only while a step stays open far longer than
# its recent steps (a stall): how long the step has been open, and how long the rank has been
# waiting in a collective (0: not in one). The rank the others wait for is not waiting.
STEP_OPEN_S = "step_open_s"
COLLECTIVE_WAIT_S = "collective_wait_s"
# Seconds, since the PyTorch producer's previous sample, during which trainscope's own
# on-demand profile of the rank was recording or being condensed (sent only then). What the rank
# and its job lose to it is trainscope's cost, not the job's (``detectors/own_cost.py``).
PROFILER_BUSY_S = "profiler_busy_s"
# Which clock a rank's phase times come from, once per window with its summaries: 1 when its
# forward, backward, optimizer step and collectives also carry their device time
# (CUDA events: the ``gpu_phase`` and ``gpu_collective`` layers), 0 when they are host times
# only (CPU jobs, backends without device events: with CUDA, host times measure launch).
PHASE_CLOCK_DEVICE = "phase_clock_device"

# NVML clocks-event (formerly "throttle") reason bits, as in nvml.h
# (``nvmlClocksEventReason*``; older bindings name them ``nvmlClocksThrottleReason*``).
THROTTLE_REASON_NAMES: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# The reasons that mean "slower than the GPU could run": power and thermal limits. Idle, and the
# clocks someone chose (application, sync-boost or display clock settings), do not — an idle
# moment between steps would otherwise turn every slow GPU into a throttled one.
THROTTLING_REASONS_MASK = 0x004 | 0x008 | 0x020 | 0x040 | 0x080

# Scheduler pseudo-functions (``FunctionSummary.layer == SCHED_LAYER``): time a thread spent
# runnable but without a CPU, summed over a process's threads. The eBPF agent reports it from
# the scheduler's tracepoints, the PyTorch producer from the kernel's schedstat; the names
# differ so that neither is added to the other.
SCHED_LAYER = "sched"
# Device (CUDA event) time of a host phase (forward, backward, optimizer.step) and of a blocking
# collective, sent beside their host times by the PyTorch producer of a CUDA job
# (``producers/torch/device_timing.py``).
DEVICE_PHASE_LAYER = "gpu_phase"
DEVICE_COLLECTIVE_LAYER = "gpu_collective"
RUNQUEUE_WAIT = "runqueue_wait"
PROCESS_RUNQUEUE_WAIT = "process_runqueue_wait"
RUNQUEUE_WAIT_FUNCTIONS = (RUNQUEUE_WAIT, PROCESS_RUNQUEUE_WAIT)
