"""Streaming the reply as it is verified: transformers' streamers, and ``pipe.stream(...)``.

``pipe(..., streamer=s)`` drives any object with transformers' streamer protocol (``put(ids)``, ``end()``), as
``generate(streamer=s)`` does: ``put`` first receives the prompt's ids (so ``skip_prompt=True`` works as with
``generate``), then the tokens of each verification step *together* (the accepted draft tokens and the bonus
token), never a token that is later taken back; ``end()`` comes last. ``TextStreamer`` and
``TextIteratorStreamer`` work unchanged.

``pipe.stream(...)`` yields :class:`StreamPiece` objects as the steps are verified: the text each step adds (a
piece is held back while it would end inside a multi-byte character) and its token ids; the last piece carries the
statistics. The pieces' texts join to exactly the final text; with a reasoning parser on the pipeline, each piece
also says what it adds to the reasoning and to the answer (:mod:`vlmspec.reasoning`). Stopping early (``break``, ``close()``, an error in
the loop) ends the generation at its next verification step and waits for it, so the models are free again.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .engine import SpecStats
from .errors import InputTypeError
from .reasoning import ReasoningParser, ReplySplitter, reply_reasoning


def check_streamer(streamer: Any) -> None:
    """Refuse a ``streamer`` that is not ``None`` and lacks transformers' streamer protocol (``put``, ``end``).

    Raises:
        TypeError: naming what it is and what a streamer is.
    """
    if streamer is None:
        return
    missing = [name for name in ("put", "end") if not callable(getattr(streamer, name, None))]
    if missing:
        raise InputTypeError(
            f"streamer={streamer!r:.80} is not a streamer: it has no {' or '.join(f'{m}()' for m in missing)}; "
            "pass a transformers streamer (TextStreamer(tokenizer), TextIteratorStreamer(tokenizer)) or any object "
            "with put(ids) and end(), or use pipe.stream(...)"
        )


@dataclass
class StreamPiece:
    """One piece of a streamed reply.

    Attributes:
        text: the text this piece adds.
        token_ids: the tokens this piece adds.
        stats: the generation's statistics, on the last piece only (``None`` before).
        reasoning, content: what the piece adds to the reply's reasoning and to its answer, as the pipeline's
            reasoning parser splits the reply (:class:`~vlmspec.reasoning.ReplySplitter`: the pieces' join to
            ``out.reasoning`` and ``out.content``); without one, the reasoning is empty and the content the text.
    """

    text: str
    token_ids: list[int]
    stats: SpecStats | None = None
    reasoning: str = ""
    content: str = ""


class TextPieces:
    """Turns a growing token list into text pieces whose concatenation is the decoded whole.

    Incremental, as vLLM's and text-generation-inference's detokenizers are: a push decodes only the tokens
    not yet sent, after those of the last piece sent as context (``tokens[prefix:]``), and sends what that adds
    to the context's own text (``tokens[prefix:read]``), so a push costs the tokens of a step or two however
    long the reply is. Decoding the context too keeps what a tokenizer does at the start of a text (a leading
    space dropped) out of the piece. Text is held back while it ends inside a character (``"\ufffd"``), or
    while it does not extend the context's text; the next push decodes it again with the tokens that complete
    it.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0
        """Where the context starts: the first token of the last piece sent."""
        self.read = 0
        """How many tokens the pieces sent cover."""
        self._context: str | None = None  # the text of tokens[prefix:read], once decoded
        self._pieces: list[str] = []

    @property
    def sent(self) -> str:
        """The text sent so far: the pieces joined."""
        self._pieces = ["".join(self._pieces)]
        return self._pieces[0]

    @sent.setter
    def sent(self, text: str) -> None:
        self._pieces = [text]

    def push(self, ids: list[int]) -> str:
        """The text ``ids`` add, or ``""`` while the text so far ends inside a character (held back)."""
        self.tokens.extend(ids)
        if self._context is None:
            self._context = self._decode(self.prefix, self.read)
        context, text = self._context, self._decode(self.prefix, len(self.tokens))
        if len(text) <= len(context) or text.endswith("\ufffd") or not text.startswith(context):
            return ""
        piece = text[len(context) :]
        self.prefix, self.read, self._context = self.read, len(self.tokens), None
        self._pieces.append(piece)
        return piece

    def finish(self, text: str) -> str:
        """What is left of the final ``text`` after the pieces already sent."""
        sent = self.sent
        piece = text[len(sent) :] if text.startswith(sent) else text
        self.sent = text
        return piece

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)


class _Cancelled(Exception):
    """Raised in the generating thread once the consumer of ``pipe.stream()`` stopped reading."""


class QueueStreamer:
    """A streamer (``put``/``end``) that queues each step's tokens with their text, keeping the prompt's ids aside;
    once ``cancelled`` is set, its next ``put`` ends the generation."""

    def __init__(self, tokenizer: Any, out: queue.Queue) -> None:
        self.pieces = TextPieces(tokenizer)
        self.out = out
        self.prompt_ids: list[int] | None = None
        """The prompt's ids, once the generation put them (before its first piece)."""
        self.cancelled = threading.Event()

    def put(self, value: torch.Tensor) -> None:
        if self.cancelled.is_set():
            raise _Cancelled
        if self.prompt_ids is None:
            self.prompt_ids = value.flatten().tolist()
            return
        ids = value.flatten().tolist()
        self.out.put(StreamPiece(self.pieces.push(ids), ids))

    def end(self) -> None:
        """Nothing to flush: the last piece (with the statistics) is sent once the call returns."""


_DONE = object()


def check_stream_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse what ``pipe.stream(**kwargs)`` cannot take: a ``streamer`` (it makes its own) or ``output_scores``
    (its pieces carry text and statistics).

    Raises:
        TypeError: naming the argument and where to use it.
    """
    if "streamer" in kwargs:
        raise InputTypeError(
            "pipe.stream() makes its own streamer; use pipe(..., streamer=...) to pass yours"
        )
    if kwargs.get("output_scores"):
        raise InputTypeError(
            "pipe.stream() yields text pieces, not scores; use pipe(..., output_scores=True) (with streamer=... to "
            "stream too) for the scores"
        )


def stream_call(pipe: Any, image: Any, prompt: str | None, kwargs: dict[str, Any]) -> Iterator[StreamPiece]:
    """``pipe.stream(image, prompt, **kwargs)``: run the call in a thread and yield its pieces as they come, each
    split into reasoning and content as the pipe's reasoning parser splits the reply.

    Raises:
        Whatever the call raised, once the pieces before it were yielded.
    """
    pieces: queue.Queue = queue.Queue()
    streamer = QueueStreamer(pipe.tokenizer, pieces)
    result: dict[str, Any] = {}
    splitter = None

    def opens() -> ReasoningParser | None:  # the prompt's ids: the streamer's once the call put them
        variables = kwargs.get("chat_template_kwargs")
        return reply_reasoning(pipe.reasoning_parser, pipe.tokenizer, streamer.prompt_ids or [], variables)

    def run() -> None:
        try:
            result["output"] = pipe(image, prompt, streamer=streamer, **kwargs)
        except BaseException as error:  # handed to the caller's thread below
            result["error"] = error
        finally:
            pieces.put(_DONE)

    worker = threading.Thread(target=run, name="vlmspec-stream", daemon=True)
    worker.start()
    try:
        while (piece := pieces.get()) is not _DONE:
            splitter = splitter or ReplySplitter(opens())
            piece.reasoning, piece.content = splitter.feed(piece.text)
            yield piece
    finally:  # also when the consumer stops early: end the generation at its next step, and wait for it
        streamer.cancelled.set()
        worker.join()
    if "error" in result:
        raise result["error"]
    output, splitter = result["output"], splitter or ReplySplitter(opens())
    last = StreamPiece(streamer.pieces.finish(output.text), [], output.stats)
    last.reasoning, last.content = splitter.feed(last.text)
    last.reasoning += splitter.finish()
    yield last
