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
# Bitmask of NVML clocks-event (throttle) reasons; decoded names live with the NVML sampler.
THROTTLE_REASONS = "throttle_reasons"
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
