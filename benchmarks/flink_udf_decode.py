"""The decode step alone, two ways, inside a Flink job (run with the Flink environment's Python).

    .venv-flink/bin/python benchmarks/flink_udf_decode.py --bootstrap-servers HOST:PORT \
        --wire json|udf --topic TOPIC

``json``: Flink's JSON format and ``CROSS JOIN UNNEST`` (what the windowing tier does);
``udf``: the ``raw`` format and a Python table function that decodes our msgpack batches
(``trainscope.schemas.codec``) and yields one row per span event. Both end in the same
aggregate (count and total per job, printed), so the difference is the decode.
Prints one JSON line: rows and seconds. Used by ``bench_flink.py --udf``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyflink.table import DataTypes, EnvironmentSettings, TableEnvironment
from pyflink.table.udf import udtf

from trainscope.engines.flink.job import default_jars, find_jars


@udtf(result_types=[DataTypes.STRING(), DataTypes.BIGINT()])
def decode_spans(payload: bytes):
    from trainscope.schemas.codec import BadMessage, decode_batch
    from trainscope.schemas.records import SpanBatch

    try:
        records = decode_batch(payload)
    except BadMessage:
        return
    for record in records:
        if isinstance(record, SpanBatch):
            job = record.job_id
            for duration in record.column("duration_ns").tolist():
                yield job, duration


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--wire", choices=("json", "udf"), required=True)
    args = parser.parse_args()
    # Batch mode: the aggregate is emitted once, not updated per row.
    t_env = TableEnvironment.create(EnvironmentSettings.in_batch_mode())
    config = t_env.get_config()
    config.set("pipeline.jars", ";".join(p.as_uri() for p in find_jars(default_jars())))
    config.set("parallelism.default", "1")
    config.set("python.executable", sys.executable)
    kafka = (f"'connector' = 'kafka', 'topic' = '{args.topic}', "
             f"'properties.bootstrap.servers' = '{args.bootstrap_servers}', "
             f"'properties.group.id' = 'decode-{args.wire}-{time.time_ns()}', "
             "'scan.startup.mode' = 'earliest-offset', 'scan.bounded.mode' = 'latest-offset'")
    if args.wire == "json":
        t_env.execute_sql(f"""CREATE TABLE src (spans ARRAY<ROW<job_id STRING,
            events ARRAY<ARRAY<BIGINT>>>>) WITH ({kafka}, 'format' = 'json',
            'json.ignore-parse-errors' = 'true')""")
        rows = """SELECT s.job_id, ev[5] AS d FROM src CROSS JOIN UNNEST(src.spans)
            AS s(job_id, events) CROSS JOIN UNNEST(s.events) AS x(ev)"""
    else:
        t_env.execute_sql(f"CREATE TABLE src (payload BYTES) WITH ({kafka}, 'format' = 'raw')")
        t_env.create_temporary_function("decode_spans", decode_spans)
        rows = ("SELECT job_id, d FROM src, LATERAL TABLE(decode_spans(payload)) "
                "AS t(job_id, d)")
    t_env.execute_sql("CREATE TABLE out_rows (job_id STRING, n BIGINT, total BIGINT) "
                      "WITH ('connector' = 'print')")
    started = time.monotonic()
    t_env.execute_sql(f"INSERT INTO out_rows SELECT job_id, COUNT(*), SUM(d) FROM ({rows}) "
                      "GROUP BY job_id").wait()
    print(json.dumps({"wire": args.wire, "elapsed_s": round(time.monotonic() - started, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
