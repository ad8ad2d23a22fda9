"""Batched decoding: many requests, each with its own tree, verified together in one target forward.

Every request runs the one decoding recipe, :func:`vlmspec.engine.speculative_generate`, unchanged: its own tree
policy (SAGE's alpha, history and depth per request), stop conditions, sampler and draft state. What is batched
is the models' work. Each request runs as a coroutine (a thread that only runs while the scheduler waits for it,
so exactly one thread runs at any time and everything stays deterministic); its model calls go through a
:class:`RowAdapter`, which hands each forward to the :class:`Batcher` and waits. When every live request waits on
a forward, the batcher runs one forward per model for all of them (the draft's first, so that requests drafting
deeper levels catch up and every verification is shared), hands each request its rows of the output and lets
them run on to their next forward.

Why coroutines rather than a second, batched engine: a tree policy is a short imperative function that asks the
draft for distributions level by level and decides from what it gets (that is how the papers write them); run
as coroutines, every policy works at any batch size as written, and the batch of one is the same code with the
scheduler out of the way (a forward runs at once).

The KV caches are :class:`~vlmspec.cache.KVStore` rows: each request keeps its own length and writes in place,
so requests at different lengths share a forward without copying or padding their caches (see that class).
A request joins by prefilling and copying its cache into a free row; a finished request leaves at once and a
queued one takes its row (continuous batching), so one long reply never holds up the rest. Prefills are merged
too, and run before any decoding forward: the requests that join together (a whole batch at the start, several
rows freed by one step) prefill each model in one forward (:meth:`~vlmspec.models.VLMAdapter.prefill_many`); a
request joining alone prefills exactly as ``generate()`` does. A prefill that reads hidden states (for an EDD
draft) runs on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import BatchCache, KVStore, RowCache
from .errors import InvalidInputError
from .models import Prefill, VLMAdapter
from .models.base import DecodeState, pad_positions
from .requests import END, RequestFeed

DRAFT_FIRST, TARGET = 0, 1  # order in which waiting forwards run when several models are waited on


@dataclass
class _Forward:
    """One request's forward, waiting to be merged with the others' of the same model."""

    adapter: VLMAdapter
    order: int
    cache: RowCache
    rows: torch.Tensor  # [1, n, D]
    position_ids: torch.Tensor  # [1, n] or [3, 1, n]
    bias: torch.Tensor  # [1, 1, n, length + n]
    hidden_layer: int | None = None
    result: tuple[torch.Tensor, torch.Tensor | None] | None = None
    error: BaseException | None = None

    rank = property(lambda self: (1, self.order))
    """Of the calls waiting, the first with the smallest rank runs (prefills first, then the draft's forwards)."""
    group = property(lambda self: (self.adapter, self.hidden_layer))
    """Calls of one group run as one forward."""

    @staticmethod
    def run_merged(calls: list[_Forward]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return run_merged(calls)


@dataclass
class _PrefillCall:
    """One joining request's prefill (its prompt's processor outputs), waiting to be merged with the others'."""

    adapter: VLMAdapter
    order: int
    inputs: dict[str, torch.Tensor]
    keep: torch.Tensor | None = None
    score_visual: bool = False
    result: Prefill | None = None
    error: BaseException | None = None

    rank = property(lambda self: (0, self.order))
    group = property(lambda self: (self.adapter, "prefill"))

    @staticmethod
    def run_merged(calls: list[_PrefillCall]) -> list[Prefill]:
        """One prefill exactly as ``generate()``'s (or the draft's pruned one); several in one forward."""
        first = calls[0]
        if len(calls) == 1:
            return [first.adapter.prefill(first.inputs, keep=first.keep, score_visual=first.score_visual)]
        inputs, keeps = [call.inputs for call in calls], [call.keep for call in calls]
        return first.adapter.prefill_many(inputs, keeps, score_visual=[call.score_visual for call in calls])


@dataclass
class _DraftStep:
    """One request's step of a multi-token drafter (:meth:`Gemma4AssistantAdapter.draft_step`'s arguments), waiting
    to be merged with the others'."""

    adapter: VLMAdapter
    order: int
    step: tuple[Any, torch.Tensor, torch.Tensor, int]  # (state, tokens [n], states [n, D], position)
    result: tuple[torch.Tensor, torch.Tensor] | None = None
    error: BaseException | None = None

    rank = property(lambda self: (1, self.order))
    group = property(lambda self: (self.adapter, "step"))

    @staticmethod
    def run_merged(calls: list[_DraftStep]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return calls[0].adapter.draft_steps([call.step for call in calls])


@dataclass
class _Request:
    index: int
    job: Callable[[], Any]
    resume: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    forward: _Forward | _PrefillCall | _DraftStep | None = None
    caches: list[RowCache] = field(default_factory=list)
    done: bool = False
    output: Any = None
    error: BaseException | None = None
    thread: threading.Thread | None = None
    stopped: bool = False  # abandoned before it ever ran: its thread ends without running the job


def _taker(items: Iterable[Any]) -> Callable[[bool], tuple[int, Any] | object]:
    """:meth:`RequestFeed.take` over an iterable: its items numbered, read one at a time."""
    numbered = enumerate(items)
    return lambda wait: next(numbered, END)


def _itself(index: int, job: Callable[[], Any]) -> Callable[[], Any]:
    return job


class Batcher:
    """Runs up to ``max_rows`` requests at once and merges their forwards (see the module docstring).

    Args:
        max_rows: the batch size: how many requests decode together.
        merge_prefills: prefill the requests that join together in one forward per model. Off, each request
            prefills as it joins: a prefix cache (:mod:`vlmspec.prefix_cache`) needs that, for a request sharing
            a prompt's prefix with one that joined just before it copies that prefix out of the other's row.
    """

    def __init__(self, max_rows: int, merge_prefills: bool = True) -> None:
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
            raise InvalidInputError(
                f"batch_size={max_rows!r} is invalid: use an integer >= 1 (how many requests decode together)"
            )
        self.max_rows = max_rows
        self.merge_prefills = merge_prefills
        self.stores: dict[int, KVStore] = {}
        self._running: _Request | None = None
        self._threaded = max_rows > 1  # a batch of one runs each request straight through, forwards at once
        self._turn = threading.Semaphore(0)  # released when the running request waits or ends

    # ---- called by requests (through RowAdapter) -----------------------------------------------------------
    def adopt(self, adapter: VLMAdapter, state: DecodeState) -> DecodeState:
        """Move a prefill's cache into a row of ``adapter``'s store."""
        store = self.stores.setdefault(id(adapter), KVStore(self.max_rows))
        state.cache = store.add_row(state.cache)
        if self._running is not None:
            self._running.caches.append(state.cache)
        return state

    def run(self, adapter: VLMAdapter, order: int, cache: RowCache, *args: Any) -> Any:
        """``adapter.run`` for one request: at once for a batch of one, else merged with the other requests'."""
        if not self._threaded:
            return adapter.run(cache, *args)
        return self._merged(_Forward(adapter, order, cache, *args))

    def draft_step(self, adapter: VLMAdapter, order: int, *step: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``adapter.draft_step(*step)`` (a multi-token drafter's) for one request: at once for a batch of one, else
        merged with the other requests' steps into one forward."""
        if not self._threaded:
            return adapter.draft_step(*step)
        return self._merged(_DraftStep(adapter, order, step))

    def prefill(
        self,
        adapter: VLMAdapter,
        order: int,
        inputs: dict[str, torch.Tensor],
        keep: torch.Tensor | None = None,
        score_visual: bool = False,
    ) -> Prefill:
        """``adapter.prefill(inputs, keep=keep, score_visual=score_visual)`` for one request: at once for a batch of
        one, else merged with the prefills of the requests joining with it."""
        if not self._threaded or not self.merge_prefills:
            return adapter.prefill(inputs, keep=keep, score_visual=score_visual)
        return self._merged(_PrefillCall(adapter, order, inputs, keep, score_visual))

    def _merged(self, call: _Forward | _PrefillCall | _DraftStep) -> Any:
        """Hand ``call`` to the scheduler, wait for the merged forward it joins; its share of the result."""
        request = self._running
        request.forward = call
        self._turn.release()  # give the turn back and wait for the merged forward
        request.resume.acquire()
        request.forward = None
        if call.error is not None:
            raise call.error
        return call.result

    # ---- the scheduler --------------------------------------------------------------------------------------
    def map(
        self, items: Iterable[Any] | RequestFeed, job: Callable[[int, Any], Callable[[], Any]] = _itself
    ) -> Iterator[tuple[int, Any, BaseException | None]]:
        """Run ``job(index, item)`` for each of ``items`` (each one request's whole decoding), ``max_rows`` at a time.

        ``items`` is read lazily: the next item only when a row is free. A :class:`RequestFeed` is read as its
        requests arrive: without waiting while some request decodes, waiting for one when none does.

        Yields ``(index, output, error)`` as each request ends (completion order); a failing request yields its
        exception and the others go on.
        """
        take = items.take if isinstance(items, RequestFeed) else _taker(items)
        if not self._threaded:
            while (item := take(True)) is not END:
                yield self._run_alone(_Request(item[0], job(*item)))
            return
        live: list[_Request] = []
        ended = False
        try:
            while live or not ended:
                while not ended and len(live) < self.max_rows:  # queued requests take the free rows
                    item = take(not live)  # wait for a request only when none is decoding
                    if item is None:
                        break
                    if item is END:
                        ended = True
                        break
                    request = _Request(item[0], job(*item))
                    live.append(request)  # before it runs: a Ctrl-C during its prefill must still end it
                    self._start(request)
                for request in [r for r in live if r.done]:
                    live.remove(request)
                    self._release(request)
                    yield request.index, request.output, request.error
                waiting = [r for r in live if not r.done]
                if waiting and len(waiting) == len(live):
                    self._merged_forward(waiting)
        finally:
            self._stop(live)

    def _run_alone(self, request: _Request) -> tuple[int, Any, BaseException | None]:
        """A batch of one: ``request`` runs straight through, its forwards at once."""
        self._running = request
        try:
            request.output = request.job()
        except Exception as error:
            request.error = error
        finally:
            self._running = None
            self._release(request)
        return request.index, request.output, request.error

    def _start(self, request: _Request) -> None:
        """Start ``request``'s thread and let it run to its first forward (or its end)."""
        request.thread = threading.Thread(
            target=self._body, args=(request,), name=f"vlmspec-request-{request.index}", daemon=True
        )
        request.thread.start()
        self._switch_to(request)

    def _stop(self, live: list[_Request]) -> None:
        """End the threads of requests abandoned mid-decoding (an error in the caller, Ctrl-C): each one's next
        forward raises, and none is left inside torch when the interpreter exits (that aborts the process)."""
        running = self._running
        if running is not None and not running.done and running.forward is None:
            self._turn.acquire()  # Ctrl-C landed while it computed: wait for its next forward or its end
            self._running = None
        for request in live:
            if not request.done:
                if request.forward is not None:
                    request.forward.error = RuntimeError("the batch was stopped")
                else:
                    request.stopped = True
                self._switch_to(request)
            self._release(request)
        for request in live:
            request.thread.join()

    def _body(self, request: _Request) -> None:
        request.resume.acquire()
        try:
            if request.stopped:
                return
            with torch.inference_mode():
                request.output = request.job()
        except BaseException as error:
            request.error = error
        finally:
            request.done = True
            self._turn.release()

    def _switch_to(self, request: _Request) -> None:
        """Let ``request`` run until it waits on a forward or ends."""
        self._running = request
        request.resume.release()
        self._turn.acquire()
        self._running = None

    def _release(self, request: _Request) -> None:
        for cache in request.caches:
            if cache.row >= 0:
                cache.store.remove_row(cache)
        request.caches.clear()

    def _merged_forward(self, waiting: list[_Request]) -> None:
        """One forward of one model for every request waiting on it; then those requests run on."""
        first = min(waiting, key=lambda r: r.forward.rank).forward
        group = [r for r in waiting if r.forward.group == first.group]
        calls = [r.forward for r in group]
        try:
            results = first.run_merged(calls)
            for call, result in zip(calls, results, strict=True):
                call.result = result
        except Exception as error:
            for call in calls:
                call.error = error
        for request in group:
            self._switch_to(request)


def run_merged(calls: list[_Forward]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Run the forwards of several requests of one model as one batched forward over the store's live rows.

    Every live row takes part (a row with no forward here gets ``n`` padding tokens), so the store's rows are the
    batch as they lie, with no gather. Row ``b`` with ``n_b`` real tokens sees its own ``L_b`` entries and its
    tokens' own mask; padding queries see only key 0 (so that no softmax row is empty).

    Returns:
        Per call: ``[1, n_b, V]`` logits and (if asked) ``[1, n_b, D]`` hidden states.
    """
    first = calls[0]
    store = first.cache.store
    by_row = {call.cache.row: call for call in calls}
    n = max(call.rows.shape[1] for call in calls)
    batch = store.rows
    end = max(store.lengths) + n
    dtype, device = first.rows.dtype, first.rows.device
    rows = first.rows.new_zeros(batch, n, first.rows.shape[2])  # [B, n, D]
    bias = torch.full(
        (batch, 1, n, end), torch.finfo(first.bias.dtype).min, dtype=first.bias.dtype, device=device
    )
    bias[:, :, :, 0] = 0
    positions = []
    counts = []
    for row in range(batch):
        call = by_row.get(row)
        if call is None:
            counts.append(0)
            positions.append(pad_positions(first.position_ids[..., :1] * 0, n))
            continue
        k = call.rows.shape[1]
        counts.append(k)
        rows[row, :k] = call.rows[0].to(dtype)
        keys = call.bias.shape[-1]  # L_b + n_b
        bias[row, :, :k, :keys] = call.bias[0]
        positions.append(pad_positions(call.position_ids, n))
    position_ids = torch.cat(positions, dim=-2)  # [B, n] or [3, B, n]
    logits, hidden = first.adapter.run(
        BatchCache(store, counts), rows, position_ids, bias, first.hidden_layer
    )
    results = []
    for call in calls:
        row, k = call.cache.row, call.rows.shape[1]
        results.append((logits[row : row + 1, :k], None if hidden is None else hidden[row : row + 1, :k]))
    return results


class RowAdapter:
    """A model adapter as one request of a batch sees it: prefills land in a store row, forwards are merged.

    Everything else is the wrapped adapter's (its family hooks, ``embed``, ``rope_ids``, ...), so the decoding
    methods below are :class:`VLMAdapter`'s own, running their single forward through the :class:`Batcher`.

    Args:
        adapter: the model's adapter.
        batcher: the batch this request belongs to.
        order: :data:`DRAFT_FIRST` for the draft, :data:`TARGET` for the target.
    """

    forward = VLMAdapter.forward
    forward_root = VLMAdapter.forward_root
    forward_hidden = VLMAdapter.forward_hidden

    def __init__(self, adapter: VLMAdapter, batcher: Batcher, order: int) -> None:
        self.adapter = adapter
        self.batcher = batcher
        self.order = order

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    def prefill(
        self, inputs: dict[str, torch.Tensor], hidden_layer: int | None = None, **options: Any
    ) -> Prefill:
        """:meth:`VLMAdapter.prefill` (same keyword arguments), merged with the prefills of the requests joining
        with this one; one that reads a hidden layer (for an EDD draft) runs at once."""
        if hidden_layer is not None:
            return self._adopted(self.adapter.prefill(inputs, hidden_layer=hidden_layer, **options))
        return self._adopted(self.batcher.prefill(self.adapter, self.order, inputs, **options))

    def extend(self, *args: Any, **kwargs: Any) -> Prefill:
        """:meth:`VLMAdapter.extend` (same arguments) of a cache of its own (a prefix cache's copy); the result
        lands in a store row."""
        return self._adopted(self.adapter.extend(*args, **kwargs))

    def _adopted(self, prefill: Prefill) -> Prefill:
        self.batcher.adopt(self.adapter, prefill.state)
        return prefill

    def prefill_soft(self, *args: Any, **kwargs: Any) -> DecodeState:
        """:meth:`EDDAdapter.prefill_soft`'s state, in a store row (a multi-token drafter's has no cache to move)."""
        state = self.adapter.prefill_soft(*args, **kwargs)
        return state if self.adapter.mtp_draft else self.batcher.adopt(self.adapter, state)

    def draft_step(self, *step: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A multi-token drafter's :meth:`~vlmspec.models.Gemma4AssistantAdapter.draft_step`, merged with the other
        requests' into one forward."""
        return self.batcher.draft_step(self.adapter, self.order, *step)

    def run(self, cache: RowCache, *args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`VLMAdapter.run` (same arguments after the cache), merged into the batch's forward."""
        return self.batcher.run(self.adapter, self.order, cache, *args)
