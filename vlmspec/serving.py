"""An OpenAI-compatible HTTP server over a pipeline: ``vlmspec serve``, or :class:`SpecServer` in Python.

Endpoints: ``POST /v1/chat/completions`` (the request and response of :mod:`vlmspec.openai_api`; streamed as
server-sent events with ``"stream": true``), ``GET /v1/models`` and ``GET /health``. Any OpenAI client works::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    reply = client.chat.completions.create(model="vlmspec", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
        {"type": "text", "text": "Describe this image."}]}])

How requests are served: every handler thread puts its request in one :class:`~vlmspec.requests.RequestFeed`,
and one scheduler thread decodes the feed with ``pipe.batch_iter(feed, batch_size)``: requests that arrive while
others decode join them at their next step, each with its own tree, all trees verified in one target forward
(continuous batching, :mod:`vlmspec.batching`); each reply is what ``pipe(messages=...)`` gives alone. A streamed
request's tokens reach its handler as each step accepts them. A client that disconnects mid-stream ends its
request at its next step, so its row goes to the next request. The standard library's HTTP server is enough for
this: the models' forwards, not the sockets, are what a request waits on.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
from concurrent.futures import Future
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .errors import VLMSpecError
from .openai_api import (
    APIError,
    ChatRequest,
    MediaAccess,
    Reply,
    StopHolder,
    chat_request,
    cut_at_stop,
    finish_reason,
    logprobs,
)
from .requests import RequestFeed
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
        self.eos_ids = eos_token_ids(pipe.target)
        self._feed = RequestFeed()
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer((host, port), _handler(self))
        self._http.daemon_threads = True
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
            self._waiting[self._feed.put(kwargs)] = future
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
                    future.set_exception(error)

    def _deliver(self, index: int, result: Any) -> None:
        with self._lock:
            future = self._waiting.pop(index, None)
        if future is None:
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    # ---- one request ----------------------------------------------------------------------------------------
    def complete(self, request: ChatRequest) -> dict[str, Any]:
        """The whole reply to ``request``."""
        output = _result(self.submit(request.kwargs))
        text, stopped = cut_at_stop(output.text, request.stop)
        reason = finish_reason(output, stopped, request.max_tokens, self.eos_ids)
        top = request.top_logprobs
        scores = None if top is None else logprobs(output, self.pipe.tokenizer, text, top)
        return Reply(self.model).completion(text, reason, output, scores)

    def stream(self, request: ChatRequest, send: Any) -> None:
        """Send the reply to ``request`` chunk by chunk (``send(dict)``); a failed send ends the request."""
        pieces: queue.Queue = queue.Queue()
        streamer = QueueStreamer(self.pipe.tokenizer, pieces)
        future = self.submit(dict(request.kwargs, streamer=streamer))
        future.add_done_callback(lambda _: pieces.put(None))
        reply, holder = Reply(self.model), StopHolder(request.stop)
        try:
            send(reply.chunk({"role": "assistant", "content": ""}))
            while (piece := pieces.get()) is not None:
                if text := holder.push(piece.text):
                    send(reply.chunk({"content": text}))
            output = _result(future)
            rest = holder.push(streamer.pieces.finish(output.text)) + holder.finish()
            if rest:
                send(reply.chunk({"content": rest}))
            reason = finish_reason(output, holder.stopped, request.max_tokens, self.eos_ids)
            send(reply.chunk({}, reason))
            if request.include_usage:
                send(reply.usage_chunk(output))
        except OSError:  # the client went away: end its request at its next step
            streamer.cancelled.set()
            raise


def _result(future: Future) -> Any:
    """The request's output; a bad request's error as a 400, anything else as a 500."""
    try:
        return future.result()
    except (VLMSpecError, ValueError, TypeError, OSError) as err:
        raise APIError(str(err)) from err
    except Exception as err:
        raise APIError(f"the server failed on this request: {type(err).__name__}: {err}", status=500) from err


def _handler(server: SpecServer) -> type[BaseHTTPRequestHandler]:
    """The request handler class of ``server``'s HTTP listener."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path in ("/health", "/v1/health"):
                self._json(HTTPStatus.OK, {"status": "ok"})
            elif not self._authorized():
                return
            elif self.path == "/v1/models":
                card = {"id": server.model, "object": "model", "created": 0, "owned_by": "vlmspec"}
                self._json(HTTPStatus.OK, {"object": "list", "data": [card]})
            else:
                self._error(APIError(f"no such endpoint: GET {self.path}", status=404))

        def do_POST(self) -> None:
            if not self._authorized():
                return
            if self.path != "/v1/chat/completions":
                self._error(
                    APIError(f"no such endpoint: POST {self.path} (try /v1/chat/completions)", status=404)
                )
                return
            try:
                request = chat_request(self._body(), server.model, server.media, server.max_tokens)
            except APIError as err:
                self._error(err)
                return
            try:
                if request.stream:
                    self._stream(request)
                else:
                    self._json(HTTPStatus.OK, server.complete(request))
            except APIError as err:
                self._error(err)
            finally:
                request.cleanup()

        def _authorized(self) -> bool:
            """Whether the request carries the server's API key (always, when it has none); else a 401 is sent."""
            if server.api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return True
            self.close_connection = True
            self._error(APIError("a missing or wrong API key: send Authorization: Bearer <key>", status=401))
            return False

        def _body(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise APIError(
                    f"the request body ({length} bytes) is larger than {MAX_BODY_BYTES} bytes", status=413
                )
            try:
                return json.loads(self.rfile.read(length))
            except ValueError as err:
                raise APIError(f"the request body is not JSON: {err}") from err

        def _stream(self, request: ChatRequest) -> None:
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                server.stream(request, lambda chunk: self._event(json.dumps(chunk)))
            except APIError as err:
                self._event(json.dumps(err.body()))
            except OSError:
                return
            self._event("[DONE]")

        def _event(self, data: str) -> None:
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, err: APIError) -> None:
            self._json(err.status, err.body())

        def log_message(self, format: str, *args: Any) -> None:
            logger.info("%s - %s", self.address_string(), format % args)

    return Handler
