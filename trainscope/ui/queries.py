"""The dashboard's questions, each one ClickHouse query: Python only passes parameters and
turns rows into dicts (and merges what each table knows of a job into its row of the jobs
list). Every query is bounded in what it returns (steps are bucketed to at most ``MAX_POINTS``
points, the heatmap to ``MAX_COLUMNS`` time columns), so a 1,024-rank job that ran for hours
gives a page of the same size as a small one.

A table the store lacks (no ``trainscope whatif`` ran on it, or nothing was written yet) reads
as empty, never as an error.

No ``FINAL``: every table deduplicates re-delivered batches at insert, so plain aggregates are
exact (see docs/stream-job.md, the stream job's guarantees).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from trainscope.store.handover import FollowedStore

MAX_POINTS = 1500
MAX_COLUMNS = 240
RUNNING_WITHIN_S = 120  # a job that sent a step this recently is shown as running

# The job's window length as the pipeline wrote it (15 s when it wrote no summaries yet): the
# narrowest time column of a heatmap.
_WINDOW_NS = """(SELECT coalesce(nullIf(min(window_end_ns - window_start_ns), 0), 15000000000)
                 FROM function_summaries WHERE job_id = {job:String})"""

# The jobs a store knows, from each table that names them: a pipeline store has step records and
# findings, a store that only ``trainscope whatif`` wrote has what-if results only. Asked one table
# at a time, so a table the store lacks leaves its part empty (see ``DashboardQueries._query``).
STEP_JOBS = """
SELECT job_id, min(start_ns) AS first_ns, max(start_ns + duration_ns) AS last_ns,
       max(step) AS last_step, uniqExact(rank) AS ranks,
       if(toUnixTimestamp64Nano(now64(9)) - last_ns < {running_ns:Int64}, 'running', 'ended')
           AS status
FROM step_records WHERE {only:String} = '' OR job_id = {only:String} GROUP BY job_id
"""

FINDING_JOBS = """
WITH last_window AS (
    SELECT job_id, max(window_start_ns) AS window_start_ns FROM findings
    WHERE {only:String} = '' OR job_id = {only:String} GROUP BY job_id
),
open AS (
    SELECT f.job_id AS job_id, uniqExact(f.rank, f.pp_stage, f.category) AS open_findings,
           groupUniqArray(f.category) AS open_categories
    FROM findings AS f
    INNER JOIN last_window AS w
        ON f.job_id = w.job_id AND f.window_start_ns = w.window_start_ns
    WHERE f.score >= {threshold:Float64}
    GROUP BY f.job_id
),
suspects AS (
    SELECT job_id, uniqExact(rank, pp_stage, category) AS suspects
    FROM findings
    WHERE score >= {threshold:Float64} AND ({only:String} = '' OR job_id = {only:String})
    GROUP BY job_id
)
SELECT w.job_id AS job_id, coalesce(o.open_findings, 0) AS open_findings,
       coalesce(o.open_categories, []) AS open_categories, coalesce(x.suspects, 0) AS suspects
FROM last_window AS w
LEFT JOIN open AS o ON w.job_id = o.job_id
LEFT JOIN suspects AS x ON w.job_id = x.job_id
"""

WHATIF_JOBS = """
SELECT job_id, max(analysed_at_ns) AS whatif_at_ns FROM whatif_results
WHERE {only:String} = '' OR job_id = {only:String} GROUP BY job_id
"""

# What a job row holds when a table says nothing of the job.
_NO_STEPS = {"first_ns": None, "last_ns": None, "last_step": None, "ranks": 0,
             "status": "no steps"}
_NO_FINDINGS = {"open_findings": 0, "open_categories": [], "suspects": 0}

# Messages the pipeline rejected (they carry no job id that could be trusted).
DEAD_LETTERS = """
SELECT count() AS count, max(received_ns) AS last_ns,
       argMax(error, received_ns) AS last_error
FROM dead_letters HAVING count > 0
"""

# Step time per step (mean over ranks and slowest rank), bucketed to at most MAX_POINTS points.
STEP_TIMES = """
WITH (SELECT greatest(1, intDiv(max(step) - min(step) + 1, {max_points:UInt32}) + 1)
      FROM step_records WHERE job_id = {job:String}) AS per_point
SELECT intDiv(step, per_point) * per_point AS step,
       intDiv(min(start_ns), 1000000) AS t_ms,
       avg(duration_ns) / 1e6 AS mean_ms,
       max(duration_ns) / 1e6 AS max_ms,
       argMax(rank, duration_ns) AS slowest_rank
FROM step_records
WHERE job_id = {job:String}
GROUP BY step
ORDER BY step
"""

# Findings at or above the threshold, one row per suspect and window: the chart's markers.
FINDING_MARKS = """
SELECT intDiv(window_end_ns, 1000000) AS t_ms, rank, pp_stage, category,
       max(score) AS max_score, argMax(message, score) AS top_message
FROM findings
WHERE job_id = {job:String} AND score >= {threshold:Float64}
GROUP BY window_end_ns, rank, pp_stage, category
ORDER BY window_end_ns, max_score DESC
"""

FINDINGS = """
SELECT rank, pp_stage, category,
       argMax(if(layer != '' AND function != '', concat(layer, '/', function), function),
              (function != '', score)) AS function_name,
       round(max(score), 3) AS max_score, count() AS findings,
       uniqExact(window_start_ns) AS windows,
       min(window_start_ns) AS first_ns, max(window_end_ns) AS last_ns,
       argMax(message, (function != '', score)) AS top_message,
       arraySort(groupUniqArrayArray(victims)) AS all_victims,
       arrayStringConcat(arraySort(groupUniqArray(detector)), ',') AS detectors,
       argMax(evidence, score) AS top_evidence
FROM findings
WHERE job_id = {job:String} AND score >= {threshold:Float64}
GROUP BY rank, pp_stage, category
ORDER BY windows * max_score DESC, rank
LIMIT 100
"""

# Per (rank, category), the newest call path the stream job's automatic profile found for
# the finding (trainscope pipeline --auto-profile); none until a profile came back, or when
# the newest profile showed no excess (an empty path).
FINDING_CALL_PATHS = """
SELECT rank, category, max(profiled_to_ns) AS newest_ns,
       argMax(path, profiled_to_ns) AS path,
       argMax(path_layers, profiled_to_ns) AS path_layers,
       argMax(delta_ns, profiled_to_ns) AS delta_ns,
       argMax(per_step, profiled_to_ns) AS per_step,
       argMax(peer_rank, profiled_to_ns) AS peer_rank,
       argMax(steps, profiled_to_ns) AS steps
FROM finding_call_paths
WHERE job_id = {job:String}
GROUP BY rank, category
HAVING length(path) > 0
"""

# The functions the heatmap can show: every (layer, name) of the job, busiest first.
FUNCTIONS = """
SELECT layer, name, sum(total_ns) / 1e9 AS total_s
FROM function_summaries WHERE job_id = {job:String}
GROUP BY layer, name ORDER BY total_s DESC LIMIT 200
"""

# Rank × time, in columns of whole windows (at most MAX_COLUMNS of them): ``col`` is the
# column's index from ``t0_ms``, in steps of ``bucket_ms`` (small numbers keep the page small).
HEATMAP_STEPS = """
WITH (SELECT min(start_ns) FROM step_records WHERE job_id = {job:String}) AS t0,
     (SELECT max(start_ns) FROM step_records WHERE job_id = {job:String}) AS t1,
     {window_ns:Int64} * (intDiv(t1 - t0, {window_ns:Int64} * {max_columns:UInt32}) + 1)
         AS bucket_ns
SELECT rank, intDiv(start_ns, bucket_ns) - intDiv(t0, bucket_ns) AS col,
       round(avg(duration_ns) / 1e6, 1) AS value
FROM step_records
WHERE job_id = {job:String}
GROUP BY rank, col
ORDER BY rank, col
"""

# One function's share of each rank's time: percent of the wall time its column covers (the
# first and last columns only from the job's first step to its last), from the summaries and
# one rank's step records: dividing by every rank's steps would cost a scan of all of them.
HEATMAP_FUNCTION = """
WITH (SELECT min(window_start_ns) FROM function_summaries WHERE job_id = {job:String}) AS t0,
     (SELECT max(window_start_ns) FROM function_summaries WHERE job_id = {job:String}) AS t1,
     {window_ns:Int64} * (intDiv(t1 - t0, {window_ns:Int64} * {max_columns:UInt32}) + 1)
         AS bucket_ns,
     (SELECT min(rank) FROM topologies ARRAY JOIN ranks AS rank WHERE job_id = {job:String})
         AS first_rank,
     (SELECT (min(start_ns), max(start_ns + duration_ns)) FROM step_records
      WHERE job_id = {job:String} AND rank = coalesce(first_rank, 0)) AS span
SELECT rank, intDiv(window_start_ns, bucket_ns) - intDiv(t0, bucket_ns) AS col,
       round(100 * sum(total_ns)
             / greatest(least((col + intDiv(t0, bucket_ns) + 1) * bucket_ns,
                              if(span.2 > 0, span.2, t1 + bucket_ns))
                        - greatest((col + intDiv(t0, bucket_ns)) * bucket_ns, span.1),
                        1), 2) AS value
FROM function_summaries
WHERE job_id = {job:String} AND layer = {layer:String} AND name = {name:String}
GROUP BY rank, col
ORDER BY rank, col
"""


def _axis(query: str) -> str:
    """The time axis of a heatmap query: its first column's start and the columns' width."""
    head = query[: query.index("SELECT rank,")]
    return head + """SELECT intDiv(intDiv(t0, bucket_ns) * bucket_ns, 1000000) AS t0_ms,
       intDiv(bucket_ns, 1000000) AS bucket_ms
"""


# One rank's functions against its peers (same pipeline stage when the layout is known), in
# milliseconds per step over [from, to). Every rank is taken to run the clicked rank's number
# of steps there, as synchronous data/pipeline parallel training does: counting each peer's
# own would cost a scan of all step records (ordered by rank, not time).
BREAKDOWN = """
WITH (SELECT any(pp_stages[indexOf(ranks, {rank:Int64})]) FROM topologies
      WHERE job_id = {job:String}) AS stage,
     (SELECT any(arrayFilter((r, s) -> s = stage, ranks, pp_stages)) FROM topologies
      WHERE job_id = {job:String}) AS peer_ranks,
     (SELECT greatest(count(), 1) FROM step_records
      WHERE job_id = {job:String} AND rank = {rank:Int64} AND start_ns >= {from_ns:Int64}
        AND start_ns < {to_ns:Int64}) AS steps,
     per_rank AS (
         SELECT rank, layer, name, sum(total_ns) / 1e6 / steps AS ms_per_step
         FROM function_summaries
         WHERE job_id = {job:String} AND window_start_ns >= {from_ns:Int64}
           AND window_start_ns < {to_ns:Int64}
           AND (empty(peer_ranks) OR has(peer_ranks, rank))
         GROUP BY rank, layer, name
     )
SELECT layer, name,
       sumIf(ms_per_step, rank = {rank:Int64}) AS rank_ms,
       quantileIf(0.5)(ms_per_step, rank != {rank:Int64}) AS peer_median_ms,
       countIf(rank != {rank:Int64}) AS peers
FROM per_rank
WHERE layer != 'step'
GROUP BY layer, name
HAVING countIf(rank = {rank:Int64}) > 0
ORDER BY rank_ms - peer_median_ms DESC
"""

OP_TRACE_OPS = "SELECT count() AS ops FROM op_traces WHERE job_id = {job:String}"
WHATIF = """
SELECT * FROM whatif_results WHERE job_id = {job:String}
ORDER BY analysed_at_ns DESC LIMIT 1
"""

# Whether a table names the job: any of the tables of ``_JOB_TABLES`` makes a job known.
EXISTS = [f"""
SELECT count() > 0 AS known FROM (SELECT 1 FROM {table} WHERE job_id = {{job:String}} LIMIT 1)
""" for table in ("step_records", "findings", "whatif_results")]


HEATMAP_STEPS, HEATMAP_FUNCTION = (
    q.replace("{window_ns:Int64}", _WINDOW_NS) for q in (HEATMAP_STEPS, HEATMAP_FUNCTION)
)
HEATMAP_STEPS_AXIS, HEATMAP_FUNCTION_AXIS = _axis(HEATMAP_STEPS), _axis(HEATMAP_FUNCTION)


class DashboardQueries:
    """The dashboard's queries on one read-only client, or on an embedded store whoever owns
    it (:class:`~trainscope.store.handover.FollowedStore`). chDB is not safe to call from
    several threads at once, and a web server answers on several: one query at a time."""

    def __init__(self, client: Any | FollowedStore, *, threshold: float,
                 running_s: float = RUNNING_WITHIN_S) -> None:
        """``running_s``: a job whose last step record is younger than this is shown as
        running, an older one as ended."""
        self._run: Callable[[Callable[[Any], Any]], Any] = (
            client.run if isinstance(client, FollowedStore) else lambda query: query(client))
        self.threshold = threshold
        self.running_s = running_s
        self._lock = threading.Lock()

    def _rows(self, sql: str, **parameters: Any) -> list[dict[str, Any]]:
        result = self._query(lambda client: client.query(sql, parameters=parameters))
        if result is None:
            return []
        names: Sequence[str] = result.column_names
        return [dict(zip(names, row, strict=True)) for row in result.result_rows]

    def _json_columns(self, sql: str, columns: int, **parameters: Any) -> bytes:
        """The result as JSON columns, serialised by ClickHouse: a rank × time matrix has
        ~250k cells, and building them as Python objects would cost more than the query."""
        raw = self._query(lambda client: client.raw_query(sql, parameters=parameters,
                                                          fmt="JSONCompactColumns"))
        return b"[" + b",".join([b"[]"] * columns) + b"]" if raw is None else bytes(raw)

    def _query(self, query: Callable[[Any], Any]) -> Any:
        """``query(client)`` under the lock; None when it reads a table the store does not
        have. Each writer creates its own tables (the pipeline's, ``trainscope whatif``'s), so
        a store lacks those of the writers that never ran on it, and this reader may not create
        them: a missing table holds no rows."""
        try:
            with self._lock:
                return self._run(query)
        except Exception as exc:
            if "UNKNOWN_TABLE" in str(exc) or "doesn't exist" in str(exc):
                return None
            raise

    def jobs(self, only: str = "") -> list[dict[str, Any]]:
        """Every job any table names, the newest data first (what-if-only jobs last)."""
        params = {"only": only, "threshold": self.threshold,
                  "running_ns": round(self.running_s * 10**9)}
        jobs: dict[str, dict[str, Any]] = {}
        for sql in (STEP_JOBS, FINDING_JOBS, WHATIF_JOBS):
            for row in self._rows(sql, **params):
                jobs.setdefault(row["job_id"], {"job_id": row["job_id"]}).update(row)
        for job in jobs.values():
            for key, default in (*_NO_STEPS.items(), *_NO_FINDINGS.items(),
                                 ("whatif_at_ns", None)):
                job.setdefault(key, default)
        return sorted(jobs.values(), key=lambda j: (j["last_ns"] is None, -(j["last_ns"] or 0),
                                                    -(j["whatif_at_ns"] or 0), j["job_id"]))

    def job(self, job_id: str) -> dict[str, Any] | None:
        if not job_id:
            return None
        return next(iter(self.jobs(only=job_id)), None)

    def known(self, job_id: str) -> bool:
        """Whether any table names the job (cheaper than :meth:`job`)."""
        return bool(job_id) and any(
            row["known"] for sql in EXISTS for row in self._rows(sql, job=job_id)
        )

    def dead_letters(self) -> dict[str, Any] | None:
        """How many messages the pipeline rejected, and the newest one's reason."""
        return next(iter(self._rows(DEAD_LETTERS)), None)

    def step_times(self, job_id: str) -> list[dict[str, Any]]:
        return self._rows(STEP_TIMES, job=job_id, max_points=MAX_POINTS)

    def finding_marks(self, job_id: str) -> list[dict[str, Any]]:
        return self._rows(FINDING_MARKS, job=job_id, threshold=self.threshold)

    def findings(self, job_id: str) -> list[dict[str, Any]]:
        """The job's findings at or above the threshold, each with the call path that explains
        it (``call_path``: None until the automatic profile of its rank came back;
        ``call_path["profiled_for"]``: the category of the finding the profile was asked for)."""
        findings = self._rows(FINDINGS, job=job_id, threshold=self.threshold)
        paths: dict[tuple[int, str], dict[str, Any]] = {}
        newest: dict[int, dict[str, Any]] = {}  # by rank, whatever finding it was asked for
        for p in self._call_paths(job_id):
            rank, p["profiled_for"] = p.pop("rank"), p.pop("category")
            paths[(rank, p["profiled_for"])] = p
            if rank not in newest or p["newest_ns"] > newest[rank]["newest_ns"]:
                newest[rank] = p
        for f in findings:
            # The loop profiles a rank on the first alert that names it and not again for a
            # while (loop/policy.py), so the rank's other findings - the window that says why
            # after an early flag, another detector's view of the same rank - show the rank's
            # newest call path, and which finding it was asked for.
            f["call_path"] = paths.get((f["rank"], f["category"])) or (
                newest.get(f["rank"]) if f["rank"] >= 0 else None)
        return findings

    def _call_paths(self, job_id: str) -> list[dict[str, Any]]:
        return self._rows(FINDING_CALL_PATHS, job=job_id)

    def functions(self, job_id: str) -> list[dict[str, Any]]:
        return self._rows(FUNCTIONS, job=job_id)

    def heatmap(self, job_id: str, layer: str = "", name: str = "") -> tuple[dict[str, Any],
                                                                               bytes]:
        """The time axis ``{t0_ms, bucket_ms}`` and the cells as JSON columns
        ``[[rank…], [col…], [value…]]``: step time in ms without a function, else the
        function's percent of the step time; ``col`` counts columns of ``bucket_ms`` from ``t0_ms``.
        """
        if not name:
            axis = self._rows(HEATMAP_STEPS_AXIS, job=job_id, max_columns=MAX_COLUMNS)
            cells = self._json_columns(HEATMAP_STEPS, 3, job=job_id, max_columns=MAX_COLUMNS)
        else:
            params = {"job": job_id, "layer": layer, "name": name, "max_columns": MAX_COLUMNS}
            axis = self._rows(HEATMAP_FUNCTION_AXIS, **params)
            cells = self._json_columns(HEATMAP_FUNCTION, 3, **params)
        return (axis[0] if axis else {"t0_ms": None, "bucket_ms": None}), cells

    def breakdown(self, job_id: str, rank: int, from_ns: int, to_ns: int) -> list[dict[str, Any]]:
        return self._rows(BREAKDOWN, job=job_id, rank=rank, from_ns=from_ns, to_ns=to_ns)

    def whatif(self, job_id: str) -> dict[str, Any] | None:
        rows = self._rows(WHATIF, job=job_id)
        return rows[0] if rows else None

    def op_trace_ops(self, job_id: str) -> int:
        """Ops of the job's what-if op trace in the store (0: none)."""
        rows = self._rows(OP_TRACE_OPS, job=job_id)
        return int(rows[0]["ops"]) if rows else 0
