"""The Flink SQL of the windowing tier, as text: tables on the bus and the queries between them.

Kept apart from the code that runs it (:mod:`trainscope.engines.flink.job`) so the statements can
be read, printed (``trainscope stream flink --print-sql``) and checked without a JVM.

Windows. The embedded engine puts a span in window ``start_ns // W`` (epoch-aligned tumbling
windows). Flink can only window on a time attribute of the *source* table, and a message holds
many events, so the watermark is defined on the message's ``t_ms`` (its earliest event start,
stamped by the producer) and every event carries its own window index (``start_ns DIV W``) as a
grouping key inside the Flink window of its message. A message that straddles a window boundary
thus contributes to the next window one firing early: that window's rows come out in two
parts, which the detection tier merges exactly (counts, totals, min/max, sketch buckets add up;
``m2_ns2`` by Chan's formula), as it merges producers' summaries that arrive in parts.

Three cascaded windows (each on the previous level's ``window_time``): level 1 groups events by
function, event window and sketch bucket ``CEIL(LN(GREATEST(d, 1)) * (1 / LN(gamma)))``
(:mod:`trainscope.schemas.sketch`), level 2 makes each function's summary and collects its
buckets and their counts with ``ARRAY_AGG``, level 3 gathers a rank's summaries of a window into
one message. ``m2_ns2`` is ``sum(d²) - sum(d)²/n`` in DOUBLE.

A batch a producer re-sent is read once (``events_once``: Flink's keep-first-row deduplication
on the producer stamp). Nothing else is dropped silently: a message the JSON format cannot
read, a span event or step record with a field it read as NULL or that the embedded engine
would reject, and an event whose window had already fired (``CURRENT_WATERMARK``) go to the
dead-letter topic, keyed by their reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainscope.schemas.sketch import GAMMA
from trainscope.schemas.topics import DEAD_LETTER_TOPIC, EVENTS_TOPIC, SUMMARIES_TOPIC

# Multiplied by the inverse, exactly as trainscope.schemas.sketch.bucket_keys does.
_INV_LN_GAMMA = repr(1.0 / math.log(GAMMA))
# The largest rank the embedded window engine takes (trainscope.engine.keys.MAX_RANK).
_MAX_RANK = (1 << 20) - 1


@dataclass(frozen=True)
class JobConfig:
    bootstrap_servers: str
    window_s: float = 15.0
    lateness_s: float = 5.0
    events_topic: str = EVENTS_TOPIC
    summaries_topic: str = SUMMARIES_TOPIC
    dead_letter_topic: str = DEAD_LETTER_TOPIC
    group: str = "trainscope-flink"
    bounded: bool = False
    # Where an unbounded job starts when its group has no committed offsets.
    start_from: str = "earliest-offset"
    source_idle_s: float = 10.0
    kafka_properties: tuple[tuple[str, str], ...] = ()

    @property
    def window_ms(self) -> int:
        window_ms = round(self.window_s * 1000)
        if window_ms <= 0 or abs(window_ms - self.window_s * 1000) > 1e-6:
            raise ValueError(
                f"window_s must be a whole number of milliseconds, got {self.window_s}"
            )
        return window_ms

    @property
    def window_ns(self) -> int:
        return self.window_ms * 1_000_000


def _interval(ms: int) -> str:
    return f"INTERVAL '{ms // 1000}.{ms % 1000:03d}' SECOND(3)"


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _kafka_options(config: JobConfig, topic: str, *, source: bool, group_suffix: str = "") -> str:
    options = {
        "connector": "kafka",
        "topic": topic,
        "properties.bootstrap.servers": config.bootstrap_servers,
        **dict(config.kafka_properties),
    }
    if source:
        # Each source its own group: both commit offsets of the same partitions.
        options["properties.group.id"] = config.group + group_suffix
        options["scan.startup.mode"] = "group-offsets"
        options["properties.auto.offset.reset"] = config.start_from.removesuffix("-offset")
        if config.bounded:
            options["scan.bounded.mode"] = "latest-offset"
    else:
        options["sink.delivery-guarantee"] = "at-least-once"
    return ",\n  ".join(f"{_quote(k)} = {_quote(v)}" for k, v in options.items())


def source_tables(config: JobConfig) -> list[str]:
    """The events topic twice: decoded by Flink's JSON format, and as raw bytes (for the
    dead-letter check, which must see the messages the JSON format cannot read)."""
    lateness_ms = round(config.lateness_s * 1000)
    return [
        f"""CREATE TABLE events (
  producer_id BIGINT,
  seq BIGINT,
  t_ms BIGINT,
  spans ARRAY<ROW<job_id STRING, layers ARRAY<STRING>, names ARRAY<STRING>,
    events ARRAY<ARRAY<BIGINT>>>>,
  steps ARRAY<ROW<job_id STRING, `rank` INT, step BIGINT, start_ns BIGINT, duration_ns BIGINT,
    samples BIGINT, tokens BIGINT, seq_len_mean DOUBLE, seq_len_max BIGINT,
    collective_ns BIGINT, device_collective_ns BIGINT>>,
  records ARRAY<STRING>,
  `partition` INT METADATA VIRTUAL,
  `offset` BIGINT METADATA VIRTUAL,
  ts AS TO_TIMESTAMP_LTZ(t_ms, 3),
  pt AS PROCTIME(),
  WATERMARK FOR ts AS ts - {_interval(lateness_ms)}
) WITH (
  {_kafka_options(config, config.events_topic, source=True)},
  'format' = 'json',
  'json.ignore-parse-errors' = 'true',
  'json.fail-on-missing-field' = 'false'
)""",
        f"""CREATE TABLE events_raw (
  payload BYTES,
  `partition` INT METADATA VIRTUAL,
  `offset` BIGINT METADATA VIRTUAL
) WITH (
  {_kafka_options(config, config.events_topic, source=True, group_suffix="-raw")},
  'format' = 'raw'
)""",
    ]


# A FunctionSummary and a StepRecord as JSON (trainscope.schemas.records), field for field.
SUMMARY_ROW = (
    "ROW<`type` STRING, v INT, job_id STRING, `rank` INT, layer STRING, name STRING, "
    "callpath_id DECIMAL(20, 0), window_start_ns BIGINT, window_end_ns BIGINT, `count` BIGINT, "
    "total_ns BIGINT, m2_ns2 DOUBLE, min_ns BIGINT, max_ns BIGINT, bytes_total BIGINT, "
    "sketch_keys ARRAY<INT>, sketch_counts ARRAY<BIGINT>>"
)
STEP_ROW = (
    "ROW<`type` STRING, v INT, job_id STRING, `rank` INT, step BIGINT, start_ns BIGINT, "
    "duration_ns BIGINT, samples BIGINT, tokens BIGINT, seq_len_mean DOUBLE, seq_len_max BIGINT, "
    "collective_ns BIGINT, device_collective_ns BIGINT>"
)


def sink_tables(config: JobConfig) -> list[str]:
    """Summaries and steps as JSON batches (``{"type": "batch", "records"|"steps": [...]}``,
    one per job, rank and window: a message per record cost the detection tier more than all
    of its detectors), other records passed on as they came, dead letters with their reason as
    the key (as the embedded pipeline writes them). Keyed by job id, so one job's records keep
    their order in one partition."""
    keyed = (
        "'key.format' = 'raw',\n  'key.fields' = 'k',\n  'value.fields-include' = 'EXCEPT_KEY'"
    )
    summaries = _kafka_options(config, config.summaries_topic, source=False)
    return [
        f"""CREATE TABLE summaries_out (
  k STRING,
  `type` STRING,
  records ARRAY<{SUMMARY_ROW}>
) WITH (
  {summaries},
  {keyed},
  'value.format' = 'json',
  'value.json.encode.decimal-as-plain-number' = 'true'
)""",
        f"""CREATE TABLE steps_out (
  k STRING,
  `type` STRING,
  steps ARRAY<{STEP_ROW}>
) WITH (
  {summaries},
  {keyed},
  'value.format' = 'json'
)""",
        f"""CREATE TABLE records_out (
  k STRING,
  record STRING
) WITH (
  {summaries},
  {keyed},
  'value.format' = 'raw'
)""",
        f"""CREATE TABLE dead_letters_out (
  reason STRING,
  payload BYTES
) WITH (
  {_kafka_options(config, config.dead_letter_topic, source=False)},
  'key.format' = 'raw',
  'key.fields' = 'reason',
  'value.fields-include' = 'EXCEPT_KEY',
  'value.format' = 'raw'
)""",
    ]


def views(config: JobConfig) -> list[str]:
    """The views between the source tables and the inserts: deduplicated messages, one row per
    span event and per step record, and the first two levels of the cascaded windows."""
    return [
        _EVENTS_ONCE,
        _span_rows(config),
        _step_rows(config),
        _bucket_rows(config),
        _summary_rows(config),
        _step_records(config),
    ]


def _late(alias: str, window_ms: int) -> str:
    """The message's window has fired (the watermark passed its last millisecond): the window
    operators, whose watermark is never ahead of this one, would drop its events silently, so
    they go to the dead letters instead."""
    return (f"CURRENT_WATERMARK({alias}.ts) IS NOT NULL AND TO_TIMESTAMP_LTZ({alias}.t_ms - "
            f"MOD({alias}.t_ms, {window_ms}) + {window_ms} - 1, 3) <= "
            f"CURRENT_WATERMARK({alias}.ts)")


# A batch a producer re-sent (the same producer id and sequence number) is read once, as the
# embedded pipeline does; unstamped batches (producer id 0) are never dropped. The state is one
# key per batch, kept for table.exec.state.ttl.
_EVENTS_ONCE = """CREATE TEMPORARY VIEW events_once AS
SELECT t_ms, spans, steps, records, `partition`, `offset`, ts FROM (
  SELECT *, ROW_NUMBER() OVER (PARTITION BY batch_key ORDER BY pt) AS copy_number FROM (
    SELECT *, CASE WHEN COALESCE(producer_id, 0) = 0
        THEN 'at ' || CAST(`partition` AS STRING) || '@' || CAST(`offset` AS STRING)
        ELSE CAST(producer_id AS STRING) || '/' || CAST(seq AS STRING) END AS batch_key
    FROM events
  )
)
WHERE copy_number = 1"""


def _span_rows(config: JobConfig) -> str:
    """One row per span event: no Python, the arrays are unnested by the JVM. An event is
    [rank, fn, step, start_ns, duration_ns, bytes_moved, callpath_id] (json_wire); the call
    path id is the signed integer of its 64 bits until the output. A field the JSON format
    could not read is NULL (json.ignore-parse-errors): such an event, or one the embedded
    engine would reject, gets a ``problem`` and goes to the dead letters instead of a window."""
    return f"""CREATE TEMPORARY VIEW span_rows AS
SELECT e.ts, e.`partition`, e.`offset`, s.job_id, CAST(ev[1] AS INT) AS `rank`,
  s.layers[CAST(ev[2] AS INT) + 1] AS layer, s.names[CAST(ev[2] AS INT) + 1] AS name,
  ev[7] AS callpath_bits, ev[4] AS start_ns, ev[5] AS duration_ns, ev[6] AS bytes_moved,
  CASE
    WHEN {_late('e', config.window_ms)} THEN 'late: its window had closed'
    WHEN ev IS NULL OR CARDINALITY(ev) <> 7 THEN 'not an array of 7 integers'
    WHEN ev[1] IS NULL OR ev[2] IS NULL OR ev[3] IS NULL OR ev[4] IS NULL OR ev[5] IS NULL
      OR ev[6] IS NULL OR ev[7] IS NULL THEN 'a field is not an integer'
    WHEN s.job_id IS NULL THEN 'its batch has no job_id'
    WHEN ev[1] < 0 OR ev[1] > {_MAX_RANK} THEN 'rank out of range'
    WHEN ev[2] < 0 OR s.layers[CAST(ev[2] AS INT) + 1] IS NULL
      OR s.names[CAST(ev[2] AS INT) + 1] IS NULL THEN 'fn is not one of its batch''s functions'
    WHEN ev[5] < 0 THEN 'negative duration_ns'
  END AS problem,
  CAST(ev AS STRING) AS event
FROM events_once AS e
CROSS JOIN UNNEST(e.spans) AS s(job_id, layers, names, events)
CROSS JOIN UNNEST(s.events) AS x(ev)"""


def _step_rows(config: JobConfig) -> str:
    """Step records like span events; their optional fields default as in StepRecord."""
    return f"""CREATE TEMPORARY VIEW step_rows AS
SELECT e.ts, e.`partition`, e.`offset`, st.job_id, st.`rank`, st.step, st.start_ns,
  st.duration_ns, COALESCE(st.samples, 0) AS samples, COALESCE(st.tokens, 0) AS tokens,
  COALESCE(st.seq_len_mean, 0.0) AS seq_len_mean, COALESCE(st.seq_len_max, 0) AS seq_len_max,
  COALESCE(st.collective_ns, 0) AS collective_ns,
  COALESCE(st.device_collective_ns, 0) AS device_collective_ns,
  CASE WHEN {_late('e', config.window_ms)} THEN 'late: its window had closed'
    WHEN st.job_id IS NULL OR st.`rank` IS NULL OR st.step IS NULL OR st.start_ns IS NULL
    OR st.duration_ns IS NULL THEN 'job_id, rank, step, start_ns or duration_ns missing or '
      || 'not of its type'
  END AS problem
FROM events_once AS e
CROSS JOIN UNNEST(e.steps) AS st(job_id, `rank`, step, start_ns, duration_ns, samples,
  tokens, seq_len_mean, seq_len_max, collective_ns, device_collective_ns)"""


def _bucket_rows(config: JobConfig) -> str:
    """Level 1: per event window and sketch bucket."""
    return f"""CREATE TEMPORARY VIEW bucket_rows AS
SELECT window_start AS l1_start, window_end AS l1_end, window_time AS l1_time, job_id, `rank`,
  layer, name, callpath_bits, event_start_ns, bucket,
  COUNT(*) AS n, SUM(duration_ns) AS total_ns,
  SUM(CAST(duration_ns AS DOUBLE) * CAST(duration_ns AS DOUBLE)) AS sum_sq,
  MIN(duration_ns) AS min_ns, MAX(duration_ns) AS max_ns, SUM(bytes_moved) AS bytes_total
FROM (
  SELECT *, CAST(CEIL(LN(CAST(GREATEST(duration_ns, 1) AS DOUBLE)) * {_INV_LN_GAMMA}) AS INT)
    AS bucket, start_ns - MOD(start_ns, {config.window_ns}) AS event_start_ns
  FROM TABLE(TUMBLE(TABLE span_rows, DESCRIPTOR(ts), {_interval(config.window_ms)}))
  WHERE problem IS NULL
)
GROUP BY window_start, window_end, window_time, job_id, `rank`, layer, name, callpath_bits,
  event_start_ns, bucket"""


def _summary_rows(config: JobConfig) -> str:
    """Level 2: the function summaries (cascaded on level 1's window_time)."""
    window_ns = config.window_ns
    return f"""CREATE TEMPORARY VIEW summary_rows AS
SELECT window_time AS l2_time, job_id, `rank`, event_start_ns,
  CAST(ROW('summary', 1, job_id, `rank`, layer, name,
    CASE WHEN callpath_bits < 0
      THEN CAST(callpath_bits AS DECIMAL(20, 0)) + CAST('18446744073709551616' AS DECIMAL(20, 0))
      ELSE CAST(callpath_bits AS DECIMAL(20, 0)) END,
    event_start_ns, event_start_ns + {window_ns},
    SUM(n), SUM(total_ns),
    GREATEST(SUM(sum_sq) - CAST(SUM(total_ns) AS DOUBLE) * CAST(SUM(total_ns) AS DOUBLE)
      / CAST(SUM(n) AS DOUBLE), 0.0),
    MIN(min_ns), MAX(max_ns), SUM(bytes_total), ARRAY_AGG(bucket), ARRAY_AGG(n))
    AS {SUMMARY_ROW}) AS summary
FROM TABLE(TUMBLE(TABLE bucket_rows, DESCRIPTOR(l1_time), {_interval(config.window_ms)}))
GROUP BY window_start, window_end, window_time, job_id, `rank`, layer, name, callpath_bits,
  event_start_ns"""


def _step_records(config: JobConfig) -> str:
    """Steps, windowed like spans; a step re-sent within the window is kept once."""
    return f"""CREATE TEMPORARY VIEW step_records AS
SELECT window_time AS l2_time, job_id, `rank`,
  CAST(ROW('step', 1, job_id, `rank`, step, start_ns, MAX(duration_ns), MAX(samples),
    MAX(tokens), MAX(seq_len_mean), MAX(seq_len_max), MAX(collective_ns),
    MAX(device_collective_ns)) AS {STEP_ROW})
    AS step_record
FROM TABLE(TUMBLE(TABLE step_rows, DESCRIPTOR(ts), {_interval(config.window_ms)}))
WHERE problem IS NULL
GROUP BY window_start, window_end, window_time, job_id, `rank`, step, start_ns"""


def inserts(config: JobConfig) -> list[str]:
    window = _interval(config.window_ms)
    return [
        # Level 3: one message per job, rank and window (cascaded on level 2's window_time).
        f"""INSERT INTO summaries_out
SELECT job_id, 'batch', ARRAY_AGG(summary)
FROM TABLE(TUMBLE(TABLE summary_rows, DESCRIPTOR(l2_time), {window}))
GROUP BY window_start, window_end, job_id, `rank`, event_start_ns""",
        f"""INSERT INTO steps_out
SELECT job_id, 'batch', ARRAY_AGG(step_record)
FROM TABLE(TUMBLE(TABLE step_records, DESCRIPTOR(l2_time), {window}))
GROUP BY window_start, window_end, job_id, `rank`""",
        # Everything else (topology, producers' own summaries, profiles) as it came.
        """INSERT INTO records_out
SELECT JSON_VALUE(record, '$.job_id'), record
FROM events_once AS e CROSS JOIN UNNEST(e.records) AS x(record)""",
        f"""INSERT INTO dead_letters_out
SELECT '{config.events_topic}[' || CAST(`partition` AS STRING) || ']@'
    || CAST(`offset` AS STRING) || ': flink job: span event ' || COALESCE(event, 'NULL')
    || ' of job ' || COALESCE(job_id, '?') || ': ' || problem,
  CAST(COALESCE(event, 'NULL') AS BYTES)
FROM span_rows
WHERE problem IS NOT NULL""",
        f"""INSERT INTO dead_letters_out
SELECT '{config.events_topic}[' || CAST(`partition` AS STRING) || ']@'
    || CAST(`offset` AS STRING) || ': flink job: step record of job ' || COALESCE(job_id, '?')
    || ': ' || problem,
  CAST('step ' || COALESCE(CAST(step AS STRING), 'NULL') || ' of rank '
    || COALESCE(CAST(`rank` AS STRING), 'NULL') AS BYTES)
FROM step_rows
WHERE problem IS NOT NULL""",
        # What the JSON format cannot read is dropped by it (json.ignore-parse-errors); the same
        # messages, read raw, are set aside here with the reason, as the embedded pipeline does.
        f"""INSERT INTO dead_letters_out
SELECT '{config.events_topic}[' || CAST(`partition` AS STRING) || ']@'
    || CAST(`offset` AS STRING) || ': ' || reason, payload
FROM (
  SELECT `partition`, `offset`, payload,
    CASE
      WHEN NOT (CAST(payload AS STRING) IS JSON OBJECT)
        THEN 'flink job: not a JSON object (producers must send TRAINSCOPE_WIRE=json)'
      WHEN JSON_VALUE(CAST(payload AS STRING), '$.type') IS DISTINCT FROM 'batch'
        THEN 'flink job: not a trainscope JSON batch (no "type": "batch")'
    END AS reason
  FROM events_raw
)
WHERE reason IS NOT NULL""",
    ]


def statements(config: JobConfig) -> list[str]:
    return [*source_tables(config), *sink_tables(config), *views(config), *inserts(config)]
