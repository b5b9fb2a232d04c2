"""The HTTP side of the read endpoint (:mod:`trainscope.store.live`): requests in ClickHouse's
HTTP interface, checked before any query reaches the engine.

Accepted as ClickHouse accepts them: ``GET /?query=…``, ``POST /`` with the query in the body
(after the ``query`` parameter's text, if any), ``param_NAME`` query parameters, the
``database`` and ``default_format`` parameters, and request bodies compressed with gzip,
deflate or LZ4 frames (clickhouse-connect sends LZ4 as several frames). Transport parameters
that change nothing the query does are tolerated; every other parameter is a setting, and
settings are refused.
"""

from __future__ import annotations

import contextlib
import gzip
import re
import socket
import zlib
from base64 import b64decode
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from trainscope.store.readonly_sql import Refused, check

# Client bookkeeping, transport and progress knobs: none changes what a query reads or runs.
_HARMLESS_PARAMS = frozenset({
    "query", "database", "default_format", "query_id", "session_id", "session_timeout",
    "session_check", "user", "password", "quota_key", "wait_end_of_query", "buffer_size",
    "send_progress_in_http_headers", "http_headers_progress_interval_ms",
    "enable_http_compression", "cancel_http_readonly_queries_on_client_close",
})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENGINE_ERROR = re.compile(r"Code: (\d+)\.")


@dataclass
class Reply:
    """An HTTP answer: status, body and extra headers."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


def error_reply(status: int, code: int, name: str, reason: str) -> Reply:
    """ClickHouse's error shape: one line ``Code: N. DB::Exception: … (NAME)``."""
    text = f"Code: {code}. DB::Exception: {reason.rstrip('.')}. ({name})\n"
    return Reply(status, text.encode(), {"X-ClickHouse-Exception-Code": str(code)})


def refused(reason: str) -> Reply:
    return error_reply(403, 164, "READONLY", f"trainscope read endpoint: {reason}")


@dataclass
class Request:
    """A query request, parsed: the SQL, its output format, parameters and database."""

    sql: str
    fmt: str
    params: dict[str, str]
    database: str | None


def parse_request(query_string: str, body: bytes) -> Request:
    """The request's query and options; :class:`Refused` for a setting or anything unknown."""
    pairs = parse_qsl(query_string, keep_blank_values=True, errors="strict")
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):
        raise Refused("a URL parameter is given twice")
    given = dict(pairs)
    params: dict[str, str] = {}
    for key, value in given.items():
        if key.startswith("param_") and _NAME.fullmatch(key[6:]):
            params[key[6:]] = value
        elif key in ("compress", "decompress", "client_protocol_version") and value in ("", "0"):
            continue  # asks for nothing we would not do
        elif key not in _HARMLESS_PARAMS:
            raise Refused(f"URL parameter {key[:60]!r} is a setting or unsupported: settings "
                          f"cannot be changed")
    fmt = given.get("default_format") or "TabSeparated"
    database = given.get("database") or None
    for what, value in (("default_format", fmt), ("database", database)):
        if value is not None and not _NAME.fullmatch(value):
            raise Refused(f"{what} must be a plain name")
    try:
        text = body.decode("utf-8", errors="strict")
    except UnicodeDecodeError:
        raise Refused("the request body is not UTF-8 text") from None
    sql = "\n".join(part for part in (given.get("query", ""), text) if part)
    check(sql)
    return Request(sql, fmt, params, database)


def decode_body(raw: bytes, encoding: str) -> bytes:
    """The body without its Content-Encoding; LZ4 and gzip may come as several frames."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    try:
        if encoding == "gzip":
            return gzip.decompress(raw)
        if encoding == "deflate":
            return zlib.decompress(raw)
        if encoding == "lz4":
            return _lz4_frames(raw)
    except (OSError, ValueError, EOFError, RuntimeError, zlib.error) as exc:
        raise Refused(f"the {encoding} request body does not decompress: {exc}") from None
    raise Refused(f"Content-Encoding {encoding[:30]!r} is not supported (use gzip, lz4 or none)")


def _lz4_frames(raw: bytes) -> bytes:
    import lz4.frame

    out: list[bytes] = []
    while raw:
        decompressor = lz4.frame.LZ4FrameDecompressor()
        out.append(decompressor.decompress(raw))
        if not decompressor.eof:
            raise ValueError("truncated LZ4 frame")
        raw = decompressor.unused_data
    return b"".join(out)


def offered_secrets(headers: Any, query_string: str) -> list[str]:
    """Every place a ClickHouse client puts a password, and a bearer token."""
    offered = [headers.get("X-ClickHouse-Key", "")]
    auth = headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "basic":
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            offered.append(b64decode(value, validate=True).decode().partition(":")[2])
    elif scheme.lower() == "bearer":
        offered.append(value.strip())
    offered += [v for k, v in parse_qsl(query_string, keep_blank_values=True) if k == "password"]
    return [o for o in offered if o]


class Handler(BaseHTTPRequestHandler):
    """One connection of the read endpoint (``self.server.live`` answers the queries)."""

    protocol_version = "HTTP/1.1"
    server_version = "trainscope-read"
    timeout = 60  # an idle or trickling connection is closed, its thread freed

    def setup(self) -> None:
        super().setup()
        # Without it a small reply waits for the client's delayed ACK: ~40 ms per query.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the owner's log is the pipeline's; one line per query would drown it

    def do_GET(self) -> None:
        self._serve(post=False)

    def do_POST(self) -> None:
        self._serve(post=True)

    def _serve(self, *, post: bool) -> None:
        url = urlsplit(self.path)
        if url.path in ("/ping", "/replicas_status") or (
                url.path == "/" and not post and not url.query):
            self._send(Reply(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"}))
            return
        if url.path != "/":
            self._send(error_reply(404, 0, "UNKNOWN", f"no handler for {url.path[:60]!r}"))
            return
        live = self.server.live  # type: ignore[attr-defined]
        if not live.authorized(offered_secrets(self.headers, url.query)):
            self._send(error_reply(403, 516, "AUTHENTICATION_FAILED",
                                   "trainscope read endpoint: a valid token is required "
                                   "(TRAINSCOPE_STORE_READ_TOKEN, sent as the password)"))
            return
        try:
            body = self._body() if post else b""
            request = parse_request(url.query, body)
        except Refused as exc:
            live.refused += 1
            self._send(refused(str(exc)))
            return
        self._send(self._run(live, request))

    def _run(self, live: Any, request: Request) -> Reply:
        try:
            return live.answer(request.sql, request.fmt, request.params, request.database)
        except Refused as exc:
            return error_reply(503, 202, "TOO_MANY_SIMULTANEOUS_QUERIES", str(exc))
        except Exception as exc:  # the engine's own error, passed on as ClickHouse words it
            text = " ".join(str(exc).split()) or type(exc).__name__
            m = _ENGINE_ERROR.search(text)
            code = int(m.group(1)) if m else 1000
            if text.startswith("Code:"):
                return Reply(500 if code != 62 else 400, (text + "\n").encode(),
                             {"X-ClickHouse-Exception-Code": str(code)})
            return error_reply(500, code, "UNKNOWN_EXCEPTION", text)

    def _body(self) -> bytes:
        if self.headers.get("Content-Type", "").lower().startswith("multipart/"):
            raise Refused("multipart requests (external data) are not supported")
        limit = self.server.live.limits.max_body_bytes  # type: ignore[attr-defined]
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw = self._chunked(limit)
        else:
            length = int(self.headers.get("Content-Length") or 0)
            if length > limit:
                self.close_connection = True
                raise Refused(f"the request body is larger than {limit} bytes")
            raw = self.rfile.read(length)
        return decode_body(raw, self.headers.get("Content-Encoding", ""))

    def _chunked(self, limit: int) -> bytes:
        out = bytearray()
        while True:
            size = int(self.rfile.readline(64).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self.rfile.readline(64)
                return bytes(out)
            if len(out) + size > limit:
                self.close_connection = True  # the rest of the body is never read
                raise Refused(f"the request body is larger than {limit} bytes")
            out += self.rfile.read(size)
            self.rfile.readline(64)

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        headers = {"Content-Type": "text/plain; charset=UTF-8",
                   "X-ClickHouse-Server-Display-Name": "trainscope", **reply.headers}
        if reply.status == 200 and "X-ClickHouse-Format" in reply.headers:
            headers["Content-Type"] = _content_type(reply.headers["X-ClickHouse-Format"])
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(reply.body)


def _content_type(fmt: str) -> str:
    low = fmt.lower()
    if low.startswith("json"):
        return "application/json; charset=UTF-8"
    if low.startswith(("tabseparated", "tsv", "csv", "pretty", "values", "markdown")):
        return "text/plain; charset=UTF-8"
    return "application/octet-stream"
