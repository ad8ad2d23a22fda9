"""An OpenAI-compatible HTTP server over a pipeline: ``vlmspec serve``, or :class:`SpecServer` in Python.

Endpoints: ``POST /v1/chat/completions`` (the request and response of :mod:`vlmspec.openai_api`; streamed as
server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(Prometheus' text format: requests, tokens, and the speculative-decoding counters, :mod:`vlmspec.server_metrics`).
Any OpenAI client works::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(model="vlmspec", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "text", "text": "Describe this image."}]}])

How requests are served: every handler thread puts its request in one :class:`~vlmspec.requests.RequestFeed`,
and one scheduler thread decodes the feed with ``pipe.batch_iter(feed, batch_size)``: requests that arrive while
others decode join them at their next step, each with its own tree, all trees verified in one target forward
(continuous batching, :mod:`vlmspec.batching`); each reply is what ``pipe(messages=...)`` gives alone. A streamed
request's tokens reach its handler as each step accepts them. A client that disconnects (streamed or not) ends
its request at its next step, so its row goes to the next request. The standard library's HTTP server is enough for
this: the models' forwards, not the sockets, are what a request waits on.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import select
import socket
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .errors import InvalidInputError, VLMSpecError
from .openai_api import (
    APIError,
    ChatRequest,
    MediaAccess,
    Reply,
    StopHolder,
    chat_request,
    choice,
    cut_at_stop,
    finish_reason,
    logprobs,
)
from .requests import RequestFeed
from .server_metrics import ServerMetrics
from .stopping import eos_token_ids
from .streaming import QueueStreamer

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 * 2**20
"""The largest request body read (images as data URIs make bodies large)."""


class SpecServer:
    """The pipeline ``pipe`` behind OpenAI's chat-completions API (module docstring).

    Args:
        pipe: the pipeline that generates.
        model: the model name clients use (``"model"`` in requests; ``/v1/models`` lists it).
        host, port: where to listen (port 0: a free port, see :attr:`url`).
        batch_size: how many requests decode together.
        max_tokens: a reply's length when the request sets none.
        media: where media URLs may be read from.
        api_key: when set, every request but ``/health`` must carry ``Authorization: Bearer <api_key>`` (401
            otherwise), as OpenAI's clients send their ``api_key``.
    """

    def __init__(
        self,
        pipe: Any,
        model: str = "vlmspec",
        host: str = "127.0.0.1",
        port: int = 8000,
        batch_size: int = 8,
        max_tokens: int = 512,
        media: MediaAccess | None = None,
        api_key: str | None = None,
    ) -> None:
        self.pipe = pipe
        self.model = model
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.media = media or MediaAccess()
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.eos_ids = eos_token_ids(pipe.target)
        self._feed = RequestFeed()
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._http = _HTTPServer((host, port), _handler(self))
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SpecServer:
        """Serve in background threads (the scheduler and the HTTP listener); :meth:`close` stops them."""
        for target, name in (
            (self._schedule, "vlmspec-scheduler"),
            (self._http.serve_forever, "vlmspec-http"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self) -> None:
        """Stop listening, let the requests already taken end, and stop the scheduler."""
        self._http.shutdown()
        self._http.server_close()
        self._feed.close()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> SpecServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- decoding -------------------------------------------------------------------------------------------
    def submit(self, kwargs: dict[str, Any]) -> Future:
        """Queue one ``pipe(...)`` request; its future gets the ``SpecOutput`` (or the request's exception)."""
        future: Future = Future()
        with self._lock:
            try:
                self._waiting[self._feed.put(kwargs)] = future
            except InvalidInputError as err:  # the feed is closed
                raise APIError("the server is shutting down: it takes no more requests", status=503) from err
        return future

    def _schedule(self) -> None:
        """Decode the feed until it is closed; a failure of the batch itself fails the requests it held."""
        while True:
            try:
                for index, result in self.pipe.batch_iter(self._feed, self.batch_size):
                    self._deliver(index, result)
                return
            except Exception as error:  # a bug, not a bad request (those are results): keep serving
                logger.exception("the batch failed; its requests get the error")
                with self._lock:
                    failed, self._waiting = self._waiting, {}
                for future in failed.values():
                    self.metrics.count(error)
                    future.set_exception(error)

    def _deliver(self, index: int, result: Any) -> None:
        self.metrics.count(result)
        with self._lock:
            future = self._waiting.pop(index, None)
        if future is None:
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    # ---- one request ----------------------------------------------------------------------------------------
    def complete(
        self, request: ChatRequest, gone: Callable[[], bool] = lambda: False
    ) -> dict[str, Any] | None:
        """The whole reply to ``request``; ``None`` if ``gone()`` said the client left first (its requests are
        then ended at their next step, so their rows go to the next requests)."""
        draws = request.n if request.kwargs.get("do_sample") else 1  # greedy replies are all the same
        seed = request.kwargs.get("seed")
        aborter = _Aborter()
        futures = [
            self.submit(dict(request.kwargs, streamer=aborter, seed=None if seed is None else seed + i))
            for i in range(draws)
        ]
        while wait(futures, timeout=POLL_SECONDS).not_done:
            if gone():
                aborter.cancelled.set()
                return None
        outputs = [_result(future) for future in futures]
        outputs += outputs[-1:] * (request.n - draws)
        return Reply(self.model).completion(
            [self._choice(i, o, request) for i, o in enumerate(outputs)], outputs
        )

    def _choice(self, index: int, output: Any, request: ChatRequest) -> dict[str, Any]:
        text, stopped = cut_at_stop(output.text, request.stop)
        reason = finish_reason(output, stopped, request.max_tokens, self.eos_ids)
        top = request.top_logprobs
        return choice(
            index, text, reason, None if top is None else logprobs(output, self.pipe.tokenizer, text, top)
        )

    def stream(self, request: ChatRequest, send: Callable[[dict[str, Any]], None]) -> None:
        """Send the reply to ``request`` chunk by chunk (``send(dict)``), the first with its first text, so that a
        request refused before any text raises :class:`APIError` before anything is sent; a failed send (the
        client left) ends the request at its next step."""
        pieces: queue.Queue = queue.Queue()
        streamer = QueueStreamer(self.pipe.tokenizer, pieces)
        future = self.submit(dict(request.kwargs, streamer=streamer))
        future.add_done_callback(lambda _: pieces.put(None))
        reply, holder = Reply(self.model), StopHolder(request.stop)
        role = {"role": "assistant"}
        try:
            while (piece := pieces.get()) is not None:
                if text := holder.push(piece.text):
                    send(reply.chunk({**role, "content": text}))
                    role = {}
            output = _result(future)
            rest = holder.push(streamer.pieces.finish(output.text)) + holder.finish()
            if rest or role:
                send(reply.chunk({**role, "content": rest}))
            send(reply.chunk({}, finish_reason(output, holder.stopped, request.max_tokens, self.eos_ids)))
            if request.include_usage:
                send(reply.usage_chunk(output))
        except OSError:
            streamer.cancelled.set()
            raise


POLL_SECONDS = 0.5
"""How often a handler waiting on a whole reply checks that its client is still there."""


class _Aborter:
    """A streamer that only ends its request (at its next step) once ``cancelled`` is set."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def put(self, value: Any) -> None:
        if self.cancelled.is_set():
            raise ConnectionAbortedError("the client went away")

    def end(self) -> None:
        """Nothing to flush."""


def _result(future: Future) -> Any:
    """The request's output; a bad request's error as a 400, anything else as a 500."""
    try:
        return future.result()
    except (VLMSpecError, ValueError, TypeError, OSError) as err:
        raise APIError(str(err)) from err
    except Exception as err:
        raise APIError(f"the server failed on this request: {type(err).__name__}: {err}", status=500) from err


class _HTTPServer(ThreadingHTTPServer):
    """The standard library's threaded server, its connection errors logged rather than printed."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):  # a client that left between two requests of its connection
            logger.info("connection from %s ended: %s", client_address, error)
        else:
            logger.exception("connection from %s failed", client_address)


CHAT_PATH = "/v1/chat/completions"
HEALTH_PATHS = ("/health", "/v1/health")
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
SOCKET_TIMEOUT = 60.0
"""Seconds a connection may stay silent while its request is read: a client that stops sending frees its thread."""


def _handler(server: SpecServer) -> type[BaseHTTPRequestHandler]:
    """The request handler class of ``server``'s HTTP listener: every answer is JSON in OpenAI's shapes (an error
    included), and a request's body is always read whole before the answer, so a kept-alive connection stays in
    step with its client."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = SOCKET_TIMEOUT

        def do_GET(self) -> None:
            self._serve(self._get)

        def do_POST(self) -> None:
            self._serve(self._post)

        def do_HEAD(self) -> None:
            self._serve(self._not_allowed)

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD

        def _serve(self, method: Callable[[], None]) -> None:
            """Run ``method``: a refusal answers with OpenAI's error body, anything unexpected with a 500, a client
            that left with nothing."""
            try:
                method()
            except APIError as err:
                self._json(err.status, err.body())
            except OSError:
                self.close_connection = True
            except Exception as err:
                logger.exception("request failed")
                failure = APIError(
                    f"the server failed on this request: {type(err).__name__}: {err}", status=500
                )
                self._json(failure.status, failure.body())

        def _route(self) -> str:
            return urlsplit(self.path).path  # query strings are ignored, as web frameworks ignore them

        def _get(self) -> None:
            path = self._route()
            if path in HEALTH_PATHS:
                return self._json(HTTPStatus.OK, {"status": "ok"})
            if path == "/metrics":  # open, as /health: scrapers send no key
                return self._send(
                    HTTPStatus.OK, server.metrics.text(len(server._waiting)).encode(), PROMETHEUS
                )
            self._authorize()
            if path == "/v1/models":
                card = {"id": server.model, "object": "model", "created": 0, "owned_by": "vlmspec"}
                return self._json(HTTPStatus.OK, {"object": "list", "data": [card]})
            if path == CHAT_PATH:
                raise APIError(f"GET {path} is not allowed: POST a request to it", status=405)
            raise APIError(f"no such endpoint: GET {path}", status=404)

        def _post(self) -> None:
            self._authorize()
            raw = self._read_body()
            path = self._route()
            if path != CHAT_PATH:
                status = 405 if path in (*HEALTH_PATHS, "/v1/models") else 404
                raise APIError(f"no such endpoint: POST {path} (POST requests to {CHAT_PATH})", status=status)
            request = chat_request(_parse_json(raw), server.model, server.media, server.max_tokens)
            try:
                if request.stream:
                    self._stream(request)
                elif (reply := server.complete(request, self._client_gone)) is not None:
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
            if server.api_key is None:
                return
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                self.close_connection = True  # its body is left unread
                raise APIError("a missing or wrong API key: send Authorization: Bearer <key>", status=401)

        def _read_body(self) -> bytes:
            """The request's body, whole (by ``Content-Length`` or chunked); a body that cannot be read in step
            closes the connection after the error."""
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
            body = b""
            while size := _chunk_size(self.rfile.readline(1024)):
                body += self._read_exactly(size)
                self.rfile.readline(1024)  # the chunk's CRLF
                if len(body) > MAX_BODY_BYTES:
                    raise APIError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413)
            while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return body

        def _client_gone(self) -> bool:
            """Whether the client closed its connection (readable with nothing to read)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _stream(self, request: ChatRequest) -> None:
            started = False

            def send(chunk: dict[str, Any]) -> None:
                nonlocal started
                if (
                    not started
                ):  # headers with the first chunk: a request refused before it gets a plain error
                    self.send_response(HTTPStatus.OK)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = started = True
                self._event(json.dumps(chunk))

            try:
                server.stream(request, send)
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

    return Handler


def _content_length(value: str | None) -> int:
    if value is None:
        raise APIError("a POST needs a Content-Length (or Transfer-Encoding: chunked)", status=411)
    if not value.strip().isdigit():
        raise APIError(f"Content-Length {value[:40]!r} is not a byte count")
    if int(value) > MAX_BODY_BYTES:
        raise APIError(
            f"the request body ({int(value)} bytes) is larger than {MAX_BODY_BYTES} bytes", status=413
        )
    return int(value)


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";")[0].strip(), 16)
    except ValueError as err:
        raise APIError(f"a chunked body's size line {line[:40]!r} is not a hexadecimal size") from err


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise APIError(f"the request body is not JSON: {str(err)[:200]}") from err
