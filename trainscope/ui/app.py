"""``trainscope ui``: a read-only web dashboard over the store (Starlette, Jinja2 templates,
Plotly charts whose JavaScript ships inside the ``plotly`` Python package; nothing comes from a
CDN at run time).

Pages are rendered on the server; the job page's charts fetch JSON from ``/api/…``, where every
figure is one ClickHouse query (:mod:`trainscope.ui.queries`).
"""

from __future__ import annotations

import importlib.resources
import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from trainscope.store.client import StoreError
from trainscope.ui.queries import DashboardQueries

HERE = Path(__file__).parent


def plotly_js() -> Path:
    """The minified Plotly bundle inside the installed ``plotly`` package."""
    path = Path(str(importlib.resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise RuntimeError(f"the plotly package has no plotly.min.js at {path}")
    return path


def _iso(ns: int | None) -> str | None:
    if ns is None:  # a job known from its what-if result only has no data times
        return None
    return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def job_url(job_id: str) -> str:
    """The job page's address. Job ids come from producers and may hold "/", "#", "?" or "..":
    every character is quoted. A browser resolves a path segment that is "." or ".." (quoted
    or not) before it sends the request, so those two ids go in the query instead."""
    if job_id in (".", ".."):
        return "/job?" + urlencode({"id": job_id})
    return "/jobs/" + quote(job_id, safe="")


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf (e.g. a median over no peers) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _json(payload: Any) -> Response:
    return JSONResponse(_clean(payload))


def _int(request: Request, name: str) -> int:
    raw = request.query_params.get(name)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise HTTPException(
            400, f"Error: query parameter {name}={raw!r} is not an integer"
        ) from None


def create_app(queries: DashboardQueries, *, source: str, refresh_s: float = 10.0) -> Starlette:
    """``refresh_s``: how often a running job's page reloads its data."""
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["iso"] = _iso
    templates.env.filters["job_url"] = job_url
    pages = _Pages(queries, templates, source=source, refresh_s=refresh_s, plotly=plotly_js())
    return Starlette(routes=[
        Route("/", pages.index),
        Route("/jobs/{job_id:path}", pages.job_page),
        Route("/api/jobs", pages.api_jobs),
        Route("/api/dead-letters", pages.api_dead_letters),
        # Job ids may hold a slash ("team/run-7"): matched as a path, up to the last segment.
        Route("/api/jobs/{job_id:path}/overview", pages.api_overview),
        Route("/api/jobs/{job_id:path}/heatmap", pages.api_heatmap),
        Route("/api/jobs/{job_id:path}/breakdown", pages.api_breakdown),
        # The same with the job id in the query (?id=…), which carries any id, "." and ".."
        # included (see job_url); the job page's script asks these.
        Route("/job", pages.job_page),
        Route("/api/job/overview", pages.api_overview),
        Route("/api/job/heatmap", pages.api_heatmap),
        Route("/api/job/breakdown", pages.api_breakdown),
        Route("/static/plotly.min.js", pages.plotly_bundle),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ], exception_handlers={StoreError: _store_unavailable})


async def _store_unavailable(request: Request, exc: Exception) -> Response:
    """The store cannot be read right now (it is changing owners): say so, retry later."""
    return PlainTextResponse(str(exc), status_code=503, headers={"Retry-After": "5"})


class _Pages:
    """The dashboard's request handlers, over one store's queries."""

    def __init__(self, queries: DashboardQueries, templates: Jinja2Templates, *, source: str,
                 refresh_s: float, plotly: Path) -> None:
        self.queries = queries
        self.templates = templates
        self.source = source
        self.refresh_s = refresh_s
        self.plotly = plotly

    @staticmethod
    def _job_id(request: Request) -> str:
        job_id = request.path_params.get("job_id", request.query_params.get("id", ""))
        return str(job_id)

    def _need_job(self, job_id: str) -> dict[str, Any]:
        job = self.queries.job(job_id)
        if job is None:
            raise HTTPException(404, f"Error: no job {job_id!r} in the store")
        return job

    def _need_known(self, job_id: str) -> None:
        if not self.queries.known(job_id):
            raise HTTPException(404, f"Error: no job {job_id!r} in the store")

    def index(self, request: Request) -> Response:
        return self.templates.TemplateResponse(request, "jobs.html", {
            "jobs": self.queries.jobs(), "dead_letters": self.queries.dead_letters(),
            "source": self.source,
            "threshold": self.queries.threshold,
        })

    def job_page(self, request: Request) -> Response:
        # The header comes with the overview the page fetches: the job's figures are
        # queried once per page, not twice.
        job_id = self._job_id(request)
        self._need_known(job_id)
        threshold = self.queries.threshold
        return self.templates.TemplateResponse(request, "job.html", {
            "job_id": job_id, "source": self.source, "threshold": threshold,
            "config": _script_json({"job_id": job_id, "threshold": threshold,
                                    "refresh_s": self.refresh_s,
                                    "from_ms": _int_or_none(request, "from_ns", 10**6),
                                    "to_ms": _int_or_none(request, "to_ns", 10**6)}),
        })

    def api_jobs(self, request: Request) -> Response:
        return _json(self.queries.jobs())

    def api_dead_letters(self, request: Request) -> Response:
        """``{count, last_ns, last_error}``; a count of 0 when none was rejected."""
        return _json(self.queries.dead_letters() or {"count": 0, "last_ns": None,
                                                      "last_error": None})

    def api_overview(self, request: Request) -> Response:
        job_id = self._job_id(request)
        job = self._need_job(job_id)
        queries = self.queries
        whatif = queries.whatif(job_id)
        if whatif is not None:
            whatif["S_worker"] = json.loads(whatif.pop("S_worker_json") or "[]")
            whatif["analysed_at"] = _iso(whatif["analysed_at_ns"])
        findings = queries.findings(job_id)
        for f in findings:
            f["first"], f["last"] = _iso(f.pop("first_ns")), _iso(f.pop("last_ns"))
        job["first"], job["last"] = _iso(job.pop("first_ns")), _iso(job.pop("last_ns"))
        job["whatif_at"] = _iso(job.pop("whatif_at_ns"))
        return _json({
            "job": job,
            "steps": queries.step_times(job_id),
            "marks": queries.finding_marks(job_id),
            "findings": findings,
            "functions": queries.functions(job_id),
            "whatif": whatif,
            # What would fill the what-if section: its command, for this store and job.
            "whatif_hint": None if whatif is not None else _whatif_hint(
                job_id, self.source, queries.op_trace_ops(job_id)),
        })

    def api_heatmap(self, request: Request) -> Response:
        job_id = self._job_id(request)
        self._need_known(job_id)
        layer = request.query_params.get("layer", "")
        name = request.query_params.get("name", "")
        axis, cells = self.queries.heatmap(job_id, layer, name)
        # The cells come as JSON from ClickHouse; only the axis is added around them.
        head = json.dumps(_clean(axis))[:-1]
        body = head + (', ' if axis else '') + '"cells": ' + cells.decode() + "}"
        return Response(body, media_type="application/json")

    def api_breakdown(self, request: Request) -> Response:
        job_id = self._job_id(request)
        self._need_known(job_id)
        rank = _int(request, "rank")
        from_ms, to_ms = _int(request, "from_ms"), _int(request, "to_ms")
        rows = self.queries.breakdown(job_id, rank, from_ms * 10**6, to_ms * 10**6)
        return _json({"rank": rank, "rows": rows})

    def plotly_bundle(self, request: Request) -> Response:
        return FileResponse(self.plotly, media_type="text/javascript",
                            headers={"Cache-Control": "max-age=86400"})


def _script_json(value: Any) -> str:
    """JSON to put inside a <script> element: a job id that holds "</script>" (job ids come
    from producers) must not end the element."""
    text = json.dumps(value)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _whatif_hint(job_id: str, source: str, ops: int) -> str:
    """How to fill the what-if section, with the command for this store and job (quoted for
    a shell): from the op trace the job sent, or how a job sends one."""
    import shlex

    flag = "--url" if source.startswith(("http://", "https://")) else "--store"
    tail = f"--job {shlex.quote(job_id)} {flag} {shlex.quote(source)}"
    if ops:
        return f"the job's op trace is in the store ({ops:,} ops): trainscope whatif {tail}"
    return ("the job sent no op trace (attach(optrace=True) or TRAINSCOPE_OPTRACE=1 sends one "
            f"to the pipeline); from a trace file: trainscope whatif --trace OPS.parquet --meta "
            f"META.yaml {tail}")


def _int_or_none(request: Request, name: str, divisor: int) -> int | None:
    raw = request.query_params.get(name)
    return int(raw) // divisor if raw and raw.lstrip("-").isdigit() else None
