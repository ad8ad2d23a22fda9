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

How requests are served: every handler thread prepares its request (media loaded, prompt built: a bad one is
refused at once) and puts it in one :class:`~vlmspec.requests.RequestFeed`, and one scheduler thread decodes the
feed with ``pipe.batch_iter(feed, batch_size)``: requests that arrive while others decode join them at their next
step, each with its own tree, all trees verified in one target forward (continuous batching,
:mod:`vlmspec.batching`); each reply is what ``pipe(messages=...)`` gives alone. A streamed request's tokens reach
its handler as each step accepts them. A client that disconnects (streamed or not) ends its request at its next
step, so its row goes to the next request; a request still queued leaves the queue at once, never
prefilled. The standard library's HTTP server is enough for this: the models' forwards, not the sockets, are
what a request waits on.

Trees are sized for ``batch_size`` requests per verification (``pipe.batch_policy``), also when fewer are
decoding: a server under light load would decode faster with the trees of a smaller batch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any

from .errors import InvalidInputError, VLMSpecError
from .openai_api import APIError, ChatRequest, MediaAccess, chat_request, refused_field
from .openai_replies import (
    Reply,
    StopHolder,
    choice,
    cut_at_stop,
    finish_reason,
    logprobs,
    reasoning_fields,
    tool_call_deltas,
    tool_reason,
)
from .openai_tools import TOOL_CALL_START
from .reasoning import ReasoningParser, ReplySplitter, reply_reasoning, split_reply
from .requests import RequestFeed
from .server_metrics import ServerMetrics
from .serving_http import HTTPServer
from .stopping import eos_token_ids
from .streaming import QueueStreamer

logger = logging.getLogger(__name__)


class SpecServer:
    """The pipeline ``pipe`` behind OpenAI's chat-completions API (module docstring).

    Args:
        pipe: the pipeline that generates.
        model: the model name clients use (``"model"`` in requests; ``/v1/models`` lists it).
        host, port: where to listen (port 0: a free port, see :attr:`url`; ``None``: no listener, requests come
            through :meth:`complete` and :meth:`stream` in Python, as the batch job sends them).
        batch_size: how many requests decode together.
        max_tokens: a reply's length when the request sets none.
        media: where media URLs may be read from.
        api_key: when set, every request but ``/health`` and ``/metrics`` must carry ``Authorization: Bearer
            <api_key>`` (401 otherwise), as OpenAI's clients send their ``api_key``.
        template_kwargs: the chat template's variables for every request (vLLM's
            ``--default-chat-template-kwargs``); a request's own ``chat_template_kwargs`` win.
    """

    def __init__(
        self,
        pipe: Any,
        model: str = "vlmspec",
        host: str = "127.0.0.1",
        port: int | None = 8000,
        batch_size: int = 8,
        max_tokens: int = 512,
        media: MediaAccess | None = None,
        api_key: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.pipe = pipe
        self.template_kwargs = dict(template_kwargs or {})
        self.model = model
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.media = media or MediaAccess()
        if api_key == "":
            raise InvalidInputError("api_key='' is invalid: give a key clients must send, or None for no key")
        self.api_key = api_key
        self.metrics = ServerMetrics()
        self.eos_ids = eos_token_ids(pipe.target)
        self._feed = RequestFeed()
        self._waiting: dict[int, tuple[Future, threading.Event | None]] = {}  # index -> future, its cancel
        self._lock = threading.Lock()
        self._http = HTTPServer((host, port), self) if port is not None else None
        self._threads: list[threading.Thread] = []
        self._closing = False

    def chat_request(self, body: Any) -> ChatRequest:
        """``body`` checked as this server takes requests (:func:`~vlmspec.openai_api.chat_request` with its model
        name, media access, default length and template variables)."""
        return chat_request(body, self.model, self.media, self.max_tokens, self.template_kwargs)

    @property
    def in_flight(self) -> int:
        """Requests queued or decoding."""
        return len(self._waiting)

    @property
    def url(self) -> str:
        if self._http is None:
            raise RuntimeError("this SpecServer was made without a listener (port=None): it has no URL")
        host, port = self._http.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SpecServer:
        """Serve in background threads (the scheduler and the HTTP listener); :meth:`close` stops them."""
        threads = [(self._schedule, "vlmspec-scheduler")]
        if self._http is not None:
            threads.append((self._http.serve_forever, "vlmspec-http"))
        for target, name in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def close(self, drain: bool = True) -> None:
        """Stop listening and stop the scheduler once the requests it has end: all of them (``drain``), or those
        already decoding, each ended at its next step, the queued ones refused with a 503 (not ``drain``)."""
        self._closing = True
        if self._http is not None:
            if self._threads:
                self._http.shutdown()
            self._http.server_close()
        dropped = self._feed.close(drop_queued=not drain)
        with self._lock:
            refused = [self._waiting.pop(index) for index, _ in dropped]
            cancels = [] if drain else [cancel for _, cancel in self._waiting.values() if cancel is not None]
        for future, _ in refused:
            future.set_exception(APIError("the server shut down before this request's turn", status=503))
        for cancel in cancels:
            cancel.set()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> SpecServer:
        return self.start()

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.close(drain=kind is None)  # an exception (Ctrl-C) ends the requests decoding at their next step

    # ---- decoding -------------------------------------------------------------------------------------------
    def submit(self, kwargs: dict[str, Any]) -> Future:
        """Queue one ``pipe(...)`` request; its future gets the ``SpecOutput`` (or the request's exception). A
        ``streamer`` in ``kwargs`` with a ``cancelled`` event is how :meth:`close` ends it early.

        The request is prepared here, in the caller's thread (its media loaded, its prompt built): a bad one is
        refused before it is queued, and the batch never waits on another request's media.

        Raises:
            APIError: the request is refused (400), or the server is shutting down (503).
        """
        future: Future = Future()
        cancel = getattr(kwargs.get("streamer"), "cancelled", None)
        try:
            call = self.pipe._prepare(kwargs)
        except BAD_REQUEST as err:
            raise APIError(str(err), refused_field(err)) from err
        with self._lock:
            try:
                self._waiting[self._feed.put(call)] = (future, cancel)
            except InvalidInputError as err:  # the feed is closed
                raise APIError("the server is shutting down: it takes no more requests", status=503) from err
        return future

    def _schedule(self) -> None:
        """Decode the feed until it is closed. A failure of the batch itself (a bug: a bad request is a result)
        fails the requests it had taken; the queued ones go to the next batch."""
        while True:
            try:
                for index, result in self.pipe.batch_iter(self._feed, self.batch_size):
                    self._deliver(index, result)
                return
            except Exception as error:
                logger.exception("the batch failed; the requests it had taken get the error")
                with self._lock:
                    taken = [index for index in self._waiting if index < self._feed.taken]
                for index in taken:
                    self._deliver(index, error)

    def _abandon(self, cancel: threading.Event) -> None:
        """End the requests of ``cancel`` (their client left): those still queued leave the queue at once,
        never prefilled (counted as failed); those decoding end at their next step."""
        cancel.set()  # first: one the scheduler takes meanwhile ends before its prefill (its streamer raises)
        with self._lock:
            indices = {index for index, (_, event) in self._waiting.items() if event is cancel}
        for index, _ in self._feed.withdraw(indices):
            self._deliver(index, ConnectionAbortedError("its client left while it was queued"))

    def _deliver(self, index: int, result: Any) -> None:
        self.metrics.count(result)
        with self._lock:
            future, _ = self._waiting.pop(index, (None, None))
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
        then ended: at their next step, so their rows go to the next requests, or before their prefill while
        queued)."""
        draws = request.n if request.kwargs.get("do_sample") else 1  # greedy replies are all the same
        self._check_logprobs_memory(request, draws)
        seed = request.kwargs.get("seed")
        aborter = _Aborter()
        futures = []
        try:
            for i in range(draws):
                kwargs = dict(request.kwargs, streamer=aborter, seed=None if seed is None else seed + i)
                futures.append(self.submit(kwargs))
        except APIError:
            self._abandon(aborter.cancelled)  # the draws already queued end too
            raise
        finally:
            request.cleanup()  # prepared: its fetched media are loaded
        while wait(futures, timeout=POLL_SECONDS).not_done:
            if gone():
                self._abandon(aborter.cancelled)
                return None
        outputs = [_result(future, self._closing) for future in futures]
        outputs += outputs[-1:] * (request.n - draws)
        return Reply(self.model).completion(
            [self._choice(i, o, request) for i, o in enumerate(outputs)], outputs
        )

    def _check_logprobs_memory(self, request: ChatRequest, draws: int) -> None:
        """Refuse logprobs whose scores would not fit :data:`LOGPROBS_BYTES` (each token keeps the target's
        logits and scores, ``2 x V`` float32, until the reply ends)."""
        if request.top_logprobs is None:
            return
        needed = draws * request.max_tokens * 2 * self.pipe.target.config.get_text_config().vocab_size * 4
        if needed > LOGPROBS_BYTES:
            raise APIError(
                f"logprobs for n={request.n} x max_tokens={request.max_tokens} would keep {needed / 2**30:.1f} GiB "
                f"of scores, more than this server allows ({LOGPROBS_BYTES / 2**30:.0f} GiB): ask for fewer "
                "tokens or choices",
                "logprobs",
            )

    def _choice(self, index: int, output: Any, request: ChatRequest) -> dict[str, Any]:
        whole, stopped = cut_at_stop(output.text, request.stop)
        opened = (
            output.reasoning is not None
        )  # the reply opened in the pipeline's reasoning parser's reasoning
        reasoning, text = split_reply(self.pipe.reasoning_parser if opened else None, whole)
        reason = finish_reason(output, stopped, request.max_tokens, self.eos_ids)
        content, calls = request.tools.calls(text) if request.tools is not None else (text, [])
        content = (
            None if opened and not content else content
        )  # no answer after the reasoning: null, as vLLM's
        top = request.top_logprobs
        scores = None if top is None else logprobs(output, self.pipe.tokenizer, whole, top)
        reasoning = reasoning if request.include_reasoning else None
        return choice(index, content, tool_reason(reason, request.tools, calls), scores, calls, reasoning)

    def stream(
        self,
        request: ChatRequest,
        send: Callable[[dict[str, Any]], None],
        gone: Callable[[], bool] = lambda: False,
    ) -> None:
        """Send the reply to ``request`` chunk by chunk (``send(dict)``), the first with its first text, so that a
        request refused before any text raises :class:`APIError` before anything is sent. A failed send, or
        ``gone()`` while no piece comes (queued, or between steps), says the client left: the request ends (as
        in :meth:`complete`) and the ``OSError`` is raised.

        Raises:
            ConnectionAbortedError: ``gone()`` said the client left.
        """
        pieces: queue.Queue = queue.Queue()
        streamer = QueueStreamer(self.pipe.tokenizer, pieces)
        try:
            future = self.submit(dict(request.kwargs, streamer=streamer))
        finally:
            request.cleanup()  # prepared: its fetched media are loaded
        future.add_done_callback(lambda _: pieces.put(None))
        tools = request.tools
        # a forced call's reply is the call's arguments: sent as a call at the end
        quiet = tools is not None and tools.forced
        # stop strings end the whole reply; a call's start is held back in the content only (not the reasoning)
        held = StopHolder([TOOL_CALL_START] if tools is not None and tools.choice == "auto" else [])
        reply, holder = Reply(self.model), StopHolder(request.stop)
        role, sent, thought = {"role": "assistant"}, "", ""  # what was sent of the content, of the reasoning
        splitter = None
        try:
            for piece in _pieces(pieces, gone):
                splitter = splitter or ReplySplitter(self._reasoning(streamer, request))
                reasoning, text = splitter.feed(holder.push(piece.text))
                if reasoning and request.include_reasoning:
                    send(reply.chunk({**role, **reasoning_fields(reasoning)}))
                    role, thought = {}, thought + reasoning
                if (text := held.push(text)) and not quiet:
                    send(reply.chunk({**role, "content": text}))
                    role, sent = {}, sent + text
            output = _result(future, self._closing)
            whole, stopped = cut_at_stop(output.text, request.stop)
            parser = splitter.parser if splitter else self._reasoning(streamer, request)
            reasoning, text = split_reply(parser, whole)
            if reasoning and request.include_reasoning and (rest := reasoning[len(thought) :]):
                send(reply.chunk({**role, **reasoning_fields(rest)}))
                role = {}
            calls = tools.calls(text)[1] if tools is not None else []
            if calls:  # the content's unsent end (none for a forced call), then the calls
                if rest := ("" if quiet else text[len(sent) : text.index(TOOL_CALL_START)]):
                    send(reply.chunk({**role, "content": rest}))
                    role = {}
                send(reply.chunk({**role, "content": None, "tool_calls": tool_call_deltas(calls)}))
            elif (rest := text[len(sent) :]) or role:
                send(reply.chunk({**role, "content": rest}))
            reason = finish_reason(output, stopped, request.max_tokens, self.eos_ids)
            send(reply.chunk({}, tool_reason(reason, tools, calls)))
            if request.include_usage:
                send(reply.usage_chunk(output))
        except OSError:
            self._abandon(streamer.cancelled)
            raise

    def _reasoning(self, streamer: QueueStreamer, request: ChatRequest) -> ReasoningParser | None:
        """The pipeline's reasoning parser if the reply to the streamed prompt opens in reasoning, else ``None``."""
        variables = request.kwargs.get("chat_template_kwargs")
        return reply_reasoning(
            self.pipe.reasoning_parser, self.pipe.tokenizer, streamer.prompt_ids or [], variables
        )


BAD_REQUEST = (VLMSpecError, ValueError, TypeError, OSError)
"""What a request's bad input raises (the library's errors, and what the libraries below it raise): a 400."""
LOGPROBS_BYTES = 2 * 2**30
"""The most memory one request's logprobs may keep (the target's distributions behind its tokens)."""
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


def _pieces(pieces: queue.Queue, gone: Callable[[], bool]) -> Iterator[Any]:
    """A streamed reply's pieces until its end (``None``), checking ``gone()`` each :data:`POLL_SECONDS` that
    none comes.

    Raises:
        ConnectionAbortedError: ``gone()`` said the client left.
    """
    while True:
        try:
            piece = pieces.get(timeout=POLL_SECONDS)
        except queue.Empty:
            if gone():
                raise ConnectionAbortedError("the client went away") from None
            continue
        if piece is None:
            return
        yield piece


def _result(future: Future, closing: bool) -> Any:
    """The request's output; its error as the server's answer: as given (an :class:`APIError`), a 503 when the
    server was closing (it ended the request), a 400 for a bad request, a 500 for anything else."""
    try:
        return future.result()
    except APIError:
        raise
    except Exception as err:
        if closing:
            raise APIError("the server shut down while this request decoded", status=503) from err
        if isinstance(err, BAD_REQUEST):
            raise APIError(str(err), refused_field(err)) from err
        raise APIError(f"the server failed on this request: {type(err).__name__}: {err}", status=500) from err
