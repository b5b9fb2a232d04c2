"""The host agent (``trainscope agent``): observes training processes without touching them.

Collectors, one module each: :mod:`.nvml` (GPU state through NVML), :mod:`.ebpf` (CUDA runtime,
NCCL and scheduler activity through bcc uprobes and tracepoints, aggregated in the kernel) and
:mod:`.host` (host CPU and network counters). :mod:`.daemon` runs whichever of them this host
supports and publishes their records to the bus. Importing this package imports neither bcc nor
pynvml: each collector imports its library when it starts.
"""
