"""The shape of a pipeline request: ``pipe(...)``'s keyword arguments, and the list ``pipe.batch`` takes, checked
before any model work, each refusal naming what was given and what to give; and the :class:`RequestFeed` of
requests that arrive while a batch decodes."""

from __future__ import annotations

import inspect
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .draft import logits_width
from .errors import InputTypeError, InvalidInputError
from .node_processors import NodeProcessing
from .processors import LogitsProcessing, OccurrencePenalties
from .reasoning import ReasoningParser
from .sampling import SamplingParams
from .stopping import StopCriteria, eos_token_ids, token_ids
from .structured import Grammar, StructuredOutputs, compile_structured
from .validation import did_you_mean

if TYPE_CHECKING:
    import torch

    from .engine import DraftPrompt
    from .scores import ScoreLog


def call_arguments(signature: inspect.Signature, request: Mapping[str, Any]) -> dict[str, Any]:
    """A request's keyword arguments for the method of ``signature`` (``VLMSpecPipeline.__call__``), defaults
    filled in.

    Raises:
        TypeError: a name ``__call__`` does not take, with the nearest one and the list of those it takes.
    """
    names = [n for n, p in signature.parameters.items() if p.kind is not p.VAR_KEYWORD and n != "self"]
    unknown = [name for name in request if name not in names]
    if unknown:
        hint = did_you_mean(unknown[0], names) if len(unknown) == 1 else ""
        raise InputTypeError(
            f"pipe(...) does not take {', '.join(unknown)}: it takes {', '.join(names)}{hint}"
        )
    bound = signature.bind(None, **request)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name in names}


END = object()
"""What a request source's ``take`` returns once it has no more requests."""


class RequestFeed:
    """Requests that arrive while a batch decodes (a server's handlers, a watcher of a folder).

    ``pipe.batch_iter(feed, batch_size)`` takes each request as a row frees, so a request put while others
    decode joins them at their next step; it waits for one only when none is decoding, and ends once the feed
    is closed and every request put before has ended. ``put``, ``withdraw`` and ``close`` may be called from
    any thread.
    """

    def __init__(self) -> None:
        self._queue: deque[tuple[int, Any]] = deque()
        self._changed = threading.Condition()
        self._closed = False
        self._count = 0
        self.taken = 0
        """How many requests were taken: those with an index below it (indices count from 0 in order)."""

    def put(self, request: Any) -> int:
        """Queue ``request`` (a dict of ``pipe(...)`` keyword arguments, or a function building one).

        Returns:
            Its index: the one ``batch_iter`` yields with its output.

        Raises:
            InvalidInputError: the feed is closed.
        """
        with self._changed:
            if self._closed:
                raise InvalidInputError(
                    "this RequestFeed is closed: it takes no more requests; make a new one"
                )
            index, self._count = self._count, self._count + 1
            self._queue.append((index, request))
            self._changed.notify_all()
        return index

    def close(self, drop_queued: bool = False) -> list[tuple[int, Any]]:
        """Take no more requests: ``batch_iter`` ends when those already taken (and, unless ``drop_queued``, those
        queued) have ended.

        Returns:
            The ``(index, request)`` pairs dropped from the queue (none unless ``drop_queued``).
        """
        with self._changed:
            self._closed = True
            dropped = list(self._queue) if drop_queued else []
            if drop_queued:
                self._queue.clear()
            self._changed.notify_all()
        return dropped

    def withdraw(self, indices: Collection[int]) -> list[tuple[int, Any]]:
        """Take the requests of ``indices`` that are still queued out of the queue (their client left): no
        batch takes them. Those already taken are not touched.

        Returns:
            The ``(index, request)`` pairs withdrawn.
        """
        with self._changed:
            withdrawn = [item for item in self._queue if item[0] in indices]
            if withdrawn:
                self._queue = deque(item for item in self._queue if item[0] not in indices)
        return withdrawn

    def take(self, wait: bool) -> tuple[int, Any] | None | object:
        """The next ``(index, request)``; ``None`` if none is queued and not ``wait``; :data:`END` once closed and
        empty. With ``wait``, blocks until a request is put or the feed is closed."""
        with self._changed:
            while wait and not self._queue and not self._closed:
                self._changed.wait()
            if self._queue:
                index, request = self._queue.popleft()
                self.taken = index + 1
                return index, request
            return END if self._closed else None


@dataclass
class PreparedRequest:
    """One request as ``pipe._prepare`` leaves it: its inputs, stop conditions, sampling settings (``None``:
    greedy), draft view and streamer, ready to decode."""

    inputs: dict[str, torch.Tensor]
    stop: StopCriteria
    sampling: SamplingParams | None
    draft: DraftPrompt | None
    streamer: Any = None
    processing: LogitsProcessing | None = None
    scores: Callable[[], ScoreLog] | None = None
    grammar: Grammar | None = None
    reasoning: ReasoningParser | None = None
    """The pipeline's reasoning parser when the reply opens in its reasoning (:func:`~vlmspec.reasoning.reply_reasoning`)."""


Requests = Iterable[dict[str, Any] | Callable[[], dict[str, Any]]] | RequestFeed
"""What ``pipe.batch_iter`` takes: requests (or functions building them, called when their turn comes), or a feed."""


def check_requests(requests: Any, where: str) -> None:
    """Refuse what is not a list (or other iterable) of requests: one request's dict, a string.

    Raises:
        TypeError: naming what was given and what to give.
    """
    if isinstance(requests, RequestFeed):
        return
    if isinstance(requests, Mapping):
        keys = ", ".join(map(repr, list(requests)[:4]))
        raise InputTypeError(
            f"{where} takes a list of requests, but got one request as a dict (keys {keys}); pass a list of dicts, "
            f"one per request ({where}([request, ...])), or call pipe(**request) for one"
        )
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise InputTypeError(
            f"{where} takes a list of requests (dicts of pipe(...) keyword arguments), got {type(requests).__name__}"
        )


def request_kwargs(request: Any, index: int | None = None) -> dict[str, Any]:
    """One request, checked to be a dict; its error names ``index`` when given (:meth:`VLMSpecPipeline.batch`
    names it itself, with every error of a request)."""
    if not isinstance(request, dict):
        where = "" if index is None else f"request {index}: "
        raise InputTypeError(
            f"{where}a {type(request).__name__} is not a request: give one dict of pipe(...) keyword arguments per "
            'request, e.g. {"image": img, "prompt": "Describe it."}'
        )
    return request


def batch_rows(requests: Any, batch_size: Any) -> Any:
    """``batch_size``, or the number of ``requests`` where that is smaller and known (a list): rows beyond the
    requests would hold nothing but their memory (each row's KV cache is allocated up front)."""
    if isinstance(batch_size, int) and isinstance(requests, Sized) and 0 < len(requests) < batch_size:
        return len(requests)
    return batch_size


def check_length(prompt_len: int, max_new_tokens: int, limit: int | None) -> None:
    """Refuse a request that would run past the target's context of ``limit`` positions (``None``: no limit)."""
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise InvalidInputError(
            f"the prompt has {prompt_len} tokens and max_new_tokens={max_new_tokens}, more than the target's "
            f"context of {limit} tokens; shorten the prompt, use fewer/smaller images or video frames, or "
            "lower max_new_tokens"
        )


def naming_request(error: Exception, index: int, where: str = "pipe.batch: request") -> Exception:
    """``error`` of the same type with the request's index in front (an ``InvalidInputError`` where that type is not
    built from one message, such as ``UnicodeDecodeError``); ``where`` names the request's kind."""
    message = f"{where} {index}: {error}"
    try:
        return type(error)(message)
    except TypeError:
        return InvalidInputError(message)


@dataclass(frozen=True)
class CallHooks:
    """A ``pipe.generate`` call's own callables for one row: ``generate()``'s ``logits_processor``,
    ``prefix_allowed_tokens_fn`` and ``stopping_criteria``.

    Attributes:
        logits_processor: processors ``generate()`` merges after its own (a ``LogitsProcessorList`` or a list),
            run node by node (:mod:`vlmspec.node_processors`).
        prefix_allowed_tokens_fn: ``fn(batch_id, input_ids) -> allowed ids``, called with ``row`` as the batch id.
        stopping_criteria: criteria ``generate()`` checks after each new token (a ``StoppingCriteriaList`` or a
            list), checked as it checks them (:class:`~vlmspec.stopping.StopCriteria`).
        row: the prompt of the call's batch this request is (``num_return_sequences`` rows share one).
        started: the call's start (``time.time()``), from which its ``max_time`` counts.
        scores_to_criteria: hand ``stopping_criteria`` the scores so far (``generate()`` does with
            ``return_dict_in_generate`` and ``output_scores``; else ``None``).

    Each is called for one row at a time, one tree node (processors) or one new token (criteria) at a time, so
    they must act row by row and keep no state between calls, as ``generate()``'s own do.
    """

    logits_processor: Sequence[Any] = ()
    prefix_allowed_tokens_fn: Callable[[int, Any], Any] | None = None
    stopping_criteria: Sequence[Any] = ()
    row: int = 0
    started: float | None = None
    scores_to_criteria: bool = False

    def __post_init__(self) -> None:
        for name in ("logits_processor", "stopping_criteria"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                kind = "LogitsProcessorList" if name == "logits_processor" else "StoppingCriteriaList"
                raise InputTypeError(
                    f"{name}={value!r:.80} is invalid: use a transformers {kind} (or a list of callables of "
                    "(input_ids, scores))"
                )
            bad = [item for item in value if not callable(item)]
            if bad:
                raise InputTypeError(
                    f"{name} holds {bad[0]!r:.60}, which is not callable: give callables of (input_ids, scores)"
                )
            if any(type(item).__module__.startswith("xgrammar") for item in value):
                raise InvalidInputError(
                    f"{name} holds xgrammar's processor, which keeps the grammar's state from call to call, and "
                    "tree nodes are not one sequence: give the structure to the pipeline instead, "
                    'pipe(..., structured_outputs={"json": schema}) (vlmspec.structured)'
                )
        fn = self.prefix_allowed_tokens_fn
        if fn is not None and not callable(fn):
            raise InputTypeError(
                f"prefix_allowed_tokens_fn={fn!r:.60}, which is not callable: give a function of (batch_id, "
                "input_ids) returning the allowed token ids"
            )


@dataclass(frozen=True)
class DecodingSettings:
    """How one request decodes: its sampling settings (``None``: greedy), its stop conditions, ``generate()``'s
    logits processors its target's ``generation_config`` and arguments turn on (``None``: none), whether its
    scores end log-softmaxed (``renormalize_logits``, :class:`~vlmspec.scores.ScoreLog`) and the structure its
    reply follows (``None``: any)."""

    sampling: SamplingParams | None
    stop: StopCriteria
    processing: LogitsProcessing | NodeProcessing | None
    renormalize: bool = False
    grammar: Grammar | None = None


def decoding_settings(
    arguments: Any,
    target: Any,
    tokenizer: Any,
    vocab_size: int,
    config: Any = None,
    custom: CallHooks | None = None,
) -> DecodingSettings:
    """A request's decoding settings from ``pipe(...)``'s arguments (``arguments``: a namespace of them),
    ``config``, the ``generation_config`` (default: the target's), and ``custom``, a ``pipe.generate`` call's own
    callables (:class:`CallHooks`), checked before any model work.

    Raises:
        InvalidInputError: a setting out of range (an ``eos_token_id`` outside the ``vocab_size`` ids, ...), or a
            ``generate()`` setting vlmspec does not apply.
    """
    a = arguments
    config = target.generation_config if config is None else config
    sampling = SamplingParams.for_call(
        a.do_sample,
        config,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
    )
    eos = (
        eos_token_ids(target, config) if a.eos_token_id is None else token_ids(a.eos_token_id, empty_ok=True)
    )
    if a.eos_token_id is not None and max(eos, default=0) >= vocab_size:
        raise InvalidInputError(
            f"eos_token_id={a.eos_token_id!r} is invalid: the vocabulary's ids are 0 to {vocab_size - 1}"
        )
    stop = StopCriteria(
        max_new_tokens=a.max_new_tokens,
        eos_token_ids=eos,
        stop_strings=a.stop_strings if a.stop_strings is not None else config.stop_strings,
        tokenizer=tokenizer,
        criteria=() if custom is None else tuple(custom.stopping_criteria),
        max_time=config.max_time,
        started=None if custom is None else custom.started,
        criteria_scores=custom is not None and custom.scores_to_criteria,
    )
    processing = LogitsProcessing.for_call(
        config,
        stop.eos_token_ids,
        repetition_penalty=a.repetition_penalty,
        min_new_tokens=a.min_new_tokens,
        occurrence=OccurrencePenalties.for_call(
            a.presence_penalty, a.frequency_penalty, a.logit_bias, target.config.get_text_config().vocab_size
        ),
        model=target,
        max_new_tokens=stop.max_new_tokens,
        custom=custom,
    )
    structure = StructuredOutputs.of(a.structured_outputs)
    grammar = None
    if structure is not None:
        grammar = compile_structured(structure, tokenizer, logits_width(target), stop.eos_token_ids)
    return DecodingSettings(sampling, stop, processing, bool(config.renormalize_logits), grammar)
