"""Configuration what-if: recommend a 3D-parallel layout and a GPU placement.

Given a model, a cluster and the bandwidth of its links (from a YAML file or measured by a
running job), :mod:`.recommend` enumerates (dp, pp, tp, micro-batch, virtual stages)
configurations, rejects those that do not fit in GPU memory (:mod:`.memory`), searches the
rank → GPU placement of each (:mod:`.search`) to minimise the step time of a critical-path
model of the 1F1B schedule (:mod:`.latency`), and explains the winners.

:mod:`.eventsim` replays the same configurations on the what-if engine's discrete-event
simulator with per-link transfer times; it is the independent reference the latency model is
checked against, never used to rank.

One convention everywhere: bandwidths are bytes per second inside the code
(``*_bytes_per_s``) and gigabits per second in files and output (``*_gbit_per_s``).
"""
