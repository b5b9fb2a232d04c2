"""The PyFlink windowing tier: Flink SQL windows the events topic into the summaries topic.

Deployment: producers → ``trainscope.events`` (JSON wire) → this Flink job
(:mod:`~trainscope.streams.flink.job`, the SQL in :mod:`~trainscope.streams.flink.sql`) →
``trainscope.summaries`` → ``trainscope pipeline --input summaries`` (detectors, ClickHouse).
The detection tier runs the same detectors and writes the same tables as the embedded pipeline;
only the windowing moved to Flink.

Runs in its own environment (``infra/setup-flink-env.sh``): apache-flink pins numpy<2.2 through
apache-beam, river needs numpy>=2.2.5. So this package imports nothing from trainscope but the
schemas layer (msgspec, numpy), and nothing from PyFlink at import time.

Wire format (measured, see benchmarks/README.md "PyFlink windowing tier"). Flink cannot read
our msgpack batches. Two ways were weighed:

(a) a JSON form of the same batch (:mod:`trainscope.schemas.json_wire`), columnar: Flink's
    built-in ``json`` format decodes it in the JVM and ``CROSS JOIN UNNEST … WITH ORDINALITY``
    turns its arrays into rows, so no Python runs per record;
(b) the ``raw`` format and a Python UDF that decodes msgpack: every message crosses into a
    Python worker and back (Beam's Fn API), where PyFlink's Python functions run at ~20k rows/s
    (DESIGN.md §6), against ~760k rows/s for SQL on JVM sources.

We chose (a): on this machine it sustained the throughput in the benchmark table (events/s per
CPU-second of the JVM), where (b)'s Python worker alone would cap it at tens of thousands
of rows/s per core. Producers switch with ``TRAINSCOPE_WIRE=json``; every consumer (embedded
pipeline, detection tier) reads both forms, so all engines read the same topic.
"""
