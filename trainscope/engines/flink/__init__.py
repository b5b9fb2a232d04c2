"""The PyFlink windowing tier: Flink SQL windows the events topic into the summaries topic.

Deployment: producers → ``trainscope.events`` (JSON wire) → this Flink job
(:mod:`~trainscope.engines.flink.job`, the SQL in :mod:`~trainscope.engines.flink.sql`) →
``trainscope.summaries`` → ``trainscope pipeline --input summaries`` (detectors, ClickHouse).
The detection tier runs the same detectors and writes the same tables as the embedded pipeline;
only the windowing moved to Flink.

Runs in its own environment (``infra/setup-flink-env.sh``): apache-flink pins numpy<2.2 through
apache-beam, river needs numpy>=2.2.5. So this package imports nothing from trainscope but the
schemas layer (msgspec, numpy), and nothing from PyFlink at import time.

Wire format (measured 2026-11-22, benchmarks/README.md "PyFlink windowing tier"). Flink cannot
read our msgpack batches. Two ways were weighed, each measured on the same 1.5 M span events as
the decode step of a Flink job, one core's CPU above the same job on an empty topic:

(a) a JSON form of the same batch (:mod:`trainscope.schemas.json_wire`): Flink's built-in
    ``json`` format decodes it in the JVM and ``CROSS JOIN UNNEST`` turns each span event (one
    short integer array) into a row, no Python per record: ~1.6 M rows per CPU-second;
(b) the ``raw`` format and a Python table function decoding msgpack
    (``benchmarks/flink_udf_decode.py``): ~0.5 M rows per CPU-second, 1.3-3.3x the CPU over
    four runs, and a Python worker with trainscope's environment on every TaskManager.

We chose (a): less CPU, and a cluster that runs the job needs no Python at all (the job plans in
Python on the client; every operator is SQL). Both are small beside the windowing itself
(~75-100 k events per CPU-second at parallelism 1, against ~190-200 k for the whole embedded
pipeline on one machine). Producers switch with ``TRAINSCOPE_WIRE=json``; every
consumer (embedded pipeline, detection tier) reads both forms, so all engines read one topic.
"""
