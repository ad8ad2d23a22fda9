"""The HTTP side of ``vlmspec serve``: the standard library's threaded server and its request handler.

Every answer is JSON in OpenAI's shapes (an error included), and a request's body is read whole before it is
answered, so a kept-alive connection stays in step with its client. What a request becomes and how it is decoded
is :class:`~vlmspec.serving.SpecServer`'s (``self.server.spec`` here).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import select
import socket
import sys
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .openai_api import APIError, ChatRequest

if TYPE_CHECKING:
    from .serving import SpecServer

logger = logging.getLogger(__name__)
CHAT_PATH = "/v1/chat/completions"
HEALTH_PATHS = ("/health", "/v1/health")
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
MAX_BODY_BYTES = 256 * 2**20
"""The largest request body read (images as data URIs make bodies large)."""
SOCKET_TIMEOUT = 60.0
"""Seconds a connection may stay silent while its request is read: a client that stops sending frees its thread."""


class HTTPServer(ThreadingHTTPServer):
    """The standard library's threaded server for ``spec``, its connection errors logged rather than printed."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], spec: SpecServer) -> None:
        self.spec = spec
        handler = type("Handler", (Handler,), {"timeout": SOCKET_TIMEOUT})  # read when the server is made
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # a client that left between two requests of its connection
            logger.info("connection from %s ended: %s", client_address, error)
        else:
            logger.exception("connection from %s failed", client_address)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests: ``GET /health``, ``/metrics``, ``/v1/models``; ``POST /v1/chat/completions``."""

    protocol_version = "HTTP/1.1"
    server: HTTPServer

    def do_GET(self) -> None:
        self._serve(self._get)

    def do_POST(self) -> None:
        self._serve(self._post)

    def do_HEAD(self) -> None:
        self._serve(self._not_allowed)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD

    def _serve(self, method: Callable[[], None]) -> None:
        """Run ``method``: a refusal answers with OpenAI's error body, anything unexpected with a 500, a client that
        left with nothing."""
        try:
            try:
                method()
            except APIError as err:
                self._json(err.status, err.body())
            except OSError:
                raise
            except Exception as err:
                logger.exception("request failed")
                failure = APIError(
                    f"the server failed on this request: {type(err).__name__}: {err}", status=500
                )
                self._json(failure.status, failure.body())
        except OSError:  # the client left (while the request was read, decoded or answered)
            self.close_connection = True

    def _route(self) -> str:
        return urlsplit(self.path).path  # query strings are ignored, as web frameworks ignore them

    def _get(self) -> None:
        spec, path = self.server.spec, self._route()
        if path in HEALTH_PATHS:
            return self._json(HTTPStatus.OK, {"status": "ok"})
        if path == "/metrics":  # open, as /health: scrapers send no key
            return self._send(
                HTTPStatus.OK, spec.metrics.text(spec.in_flight, spec.pipe.prefix_cache).encode(), PROMETHEUS
            )
        self._authorize()
        if path == "/v1/models":
            card = {"id": spec.model, "object": "model", "created": 0, "owned_by": "vlmspec"}
            return self._json(HTTPStatus.OK, {"object": "list", "data": [card]})
        if path == CHAT_PATH:
            raise APIError(f"GET {path} is not allowed: POST a request to it", status=405)
        raise APIError(f"no such endpoint: GET {path}", status=404)

    def _post(self) -> None:
        spec = self.server.spec
        self._authorize()
        raw = self._read_body()
        path = self._route()
        if path != CHAT_PATH:
            status = 405 if path in (*HEALTH_PATHS, "/metrics", "/v1/models") else 404
            raise APIError(f"no such endpoint: POST {path} (POST requests to {CHAT_PATH})", status=status)
        request = spec.chat_request(_parse_json(raw))
        try:
            if request.stream:
                self._stream(request)
            elif (reply := spec.complete(request, self._client_gone)) is not None:
                self._json(HTTPStatus.OK, reply)
            else:
                self.close_connection = True
        finally:
            request.cleanup()

    def _not_allowed(self) -> None:
        self.close_connection = True
        raise APIError(
            f"{self.command} is not allowed: GET /v1/models or /health, POST {CHAT_PATH}", status=405
        )

    def _authorize(self) -> None:
        """Raise a 401 unless the request carries the server's API key (when it has one)."""
        key = self.server.spec.api_key
        if key is None:
            return
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            self.close_connection = True  # its body is left unread
            raise APIError("a missing or wrong API key: send Authorization: Bearer <key>", status=401)

    def _read_body(self) -> bytes:
        """The request's body, whole (by ``Content-Length`` or chunked); a body that cannot be read in step closes
        the connection after the error."""
        try:
            if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                return self._read_chunks()
            return self._read_exactly(_content_length(self.headers.get("Content-Length")))
        except APIError:
            self.close_connection = True
            raise
        except TimeoutError as err:
            self.close_connection = True
            raise APIError(
                f"the request body did not arrive within {SOCKET_TIMEOUT:.0f} s", status=408
            ) from err

    def _read_exactly(self, length: int) -> bytes:
        data = self.rfile.read(length)
        if len(data) < length:
            raise APIError(f"the body ended after {len(data)} of its Content-Length's {length} bytes")
        return data

    def _read_chunks(self) -> bytes:
        body = bytearray()
        while size := _chunk_size(self.rfile.readline(1024)):
            if len(body) + size > MAX_BODY_BYTES:
                raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
            body += self._read_exactly(size)
            self.rfile.readline(1024)  # the chunk's CRLF
        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return bytes(body)

    def _client_gone(self) -> bool:
        """Whether the client closed its connection (readable with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _stream(self, request: ChatRequest) -> None:
        """Server-sent events, the headers with the first chunk: a request refused before it gets a plain error."""
        started = False

        def send(chunk: dict[str, Any]) -> None:
            nonlocal started
            if not started:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = started = True
            self._event(json.dumps(chunk))

        try:
            self.server.spec.stream(request, send, self._client_gone)
        except APIError as err:
            if not started:
                raise
            self._event(json.dumps(err.body()))
        self._event("[DONE]")

    def _event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if status == 405:
            self.send_header("Allow", "GET, POST")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s - %s", self.address_string(), format % args)


def _content_length(value: str | None) -> int:
    if value is None:
        raise APIError("a POST needs a Content-Length (or Transfer-Encoding: chunked)", status=411)
    if not re.fullmatch(r"\s*[0-9]+\s*", value):
        raise APIError(f"Content-Length {value[:40]!r} is not a byte count")
    if int(value) > MAX_BODY_BYTES:
        raise APIError(
            f"the request body ({int(value)} bytes) is larger than {MAX_BODY_BYTES} bytes", status=413
        )
    return int(value)


def _chunk_size(line: bytes) -> int:
    if not re.fullmatch(rb"\s*[0-9a-fA-F]{1,12}\s*(;.*)?\s*", line, re.DOTALL):
        raise APIError(f"a chunked body's size line {line[:40]!r} is not a hexadecimal size")
    return int(line.split(b";")[0].strip(), 16)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise APIError(f"the request body is not JSON: {str(err)[:200]}") from err
