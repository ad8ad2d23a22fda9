"""Prefix caching: a request that starts as an earlier one did prefills only what comes after.

    pipe.prefix_cache = PrefixCache(max_bytes=2**30)
    pipe(image, "Describe the picture.")
    pipe(image, "How many shapes are there?")   # the image comes from the cache: only the question runs

When a request ends, each model's KV cache is kept with the token ids of the positions it holds (the prompt, then
the reply) and the processed media behind them: an *entry*. A later request takes the entry that shares the
longest prefix of token ids with its prompt, copies its caches, drops what it does not share and runs only the
rest of its prompt (:meth:`~vlmspec.models.VLMAdapter.extend`). The prompts of requests still decoding in the
same batch count as entries too (copied out of their batch rows), so two questions about one picture sent together
share it as well. This is vLLM's automatic prefix caching and
SGLang's radix cache with whole requests as the unit, and what a conversation (:mod:`vlmspec.chat`) does between
its turns: a chat is a prefix cache of one entry. It pays where prompts repeat their starts: conversations sent
whole each turn (OpenAI clients re-send the history, so a turn finds the last turn's prompt and reply), several
questions about one image or video, a long shared system prompt.

What keeps reuse exact (:class:`TurnCache`):

* Prefixes are compared by token ids, not by messages, so reuse stays exact whatever a chat template does with
  an assistant turn (Qwen3-VL's drops thinking; some templates re-tokenise a reply's text differently from the
  ids generated).
* Media are compared by what the processor made of them (pixels, grids, frame timings, copied when the request
  starts), value for value: an image edited in place, another window of a video or another ``num_frames`` is
  another medium, even where the placeholder tokens are the same.
* An entry's images and videos are reused all together or not at all: only when the request's media start with
  the entry's and the shared prefix holds every one of them. Otherwise only the text before the entry's first
  image or video is reused (a long system prompt shared by requests about other pictures), as when the shared
  prefix stops inside a medium (LLaVA-OneVision tiles an image differently once a second one joins it).
* Positions come from the whole new prompt (M-RoPE ``rope_delta`` included), so the positions run sit where a
  fresh prefill puts them. A reply's last token is in a cache only when a stop condition cut its step short; the
  token ids bound the reuse either way, so a position the cache lacks is run again.
* A pruned draft keeps its earlier choices and prunes the new visual tokens with the target's scores of this
  request; tokens a draft had not consumed when its reply ended are run with the new prompt. An EDD draft reads
  the target's hidden states of the positions the target runs; positions between its cache and those stay out of
  its context, which costs acceptance, never correctness (the target decides every token).

Greedy replies stay the target's own ``generate()`` token for token, up to the floating-point difference of
running a prompt in two pieces instead of one (tested on the testbed pairs, whose margins make ties rare).

Memory: an entry holds both models' caches and its media's tensors. An entry that a newer one extends with the
same media (a conversation's previous turn) is dropped at once; the least recently used go once the entries pass
``max_bytes`` (or ``max_entries``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .batching import TARGET
from .cache import cache_nbytes, can_cut_back, checkpoint, copy_cache, in_use, restore, standalone, truncate
from .errors import InvalidInputError
from .models import DecodeState, Prefill, VLMAdapter
from .recurrent_cache import Checkpoint


@dataclass(eq=False)
class Held:
    """What one model's cache holds once a request ended, or of its prompt while it decodes (the fields of a
    :class:`TurnCache`), as a prefix cache lends it to a request."""

    state: DecodeState
    ids: list[int]
    slots: torch.Tensor
    prompt_len: int
    media: tuple[int, int]
    source: Any = None
    """``weakref`` to the adapter of the model whose cache it is: another model's is never reused."""
    same_media: bool = True
    """Whether the request that takes it starts with its media (else only the text before them is reused)."""
    owned: bool = False
    """Whether the request that takes it may change its cache in place (else it copies what it keeps)."""
    checkpoint: Checkpoint | None = None
    """A hybrid model's recurrent states at its prompt's end (a cache of one can be cut back there, and only there)."""


@dataclass(eq=False)
class _Entry:
    held: dict[int, Held]  # by model order (batching.DRAFT_FIRST, TARGET)
    media: dict[str, torch.Tensor]
    nbytes: int


class TurnCache:
    """One model's KV cache as one request sees it: the adapter, with prefills that start from what the cache holds.

    Everything but the prefills is the adapter's own. :meth:`next_turn` gives the prompt's ids and media counts
    before decoding; :meth:`end_turn` the reply after it.

    Args:
        adapter: the model's adapter (as the request sees it: a batch row's :class:`~vlmspec.batching.RowAdapter`).
        placeholders: the pair's image and video placeholder token ids.
        held: what the cache starts from (an entry's :class:`Held`: what is kept of it is copied at the prefill,
            unless it is ``owned``), or ``None`` (empty).

    Attributes:
        state: the model's decoding state (``None`` before the first prefill or after :meth:`drop`).
        ids: token ids of the logical positions the cache may hold: the last prompt it prefilled, then the reply.
        slots: ``[S]`` logical positions of the cache slots the prefills wrote (all of them, or a pruned draft's
            kept ones); the slots after them hold the reply's tokens, one position each from ``prompt_len`` on.
    """

    def __init__(self, adapter: Any, placeholders: Sequence[int], held: Held | None = None) -> None:
        self.adapter = adapter
        self.placeholders = torch.tensor(placeholders, dtype=torch.long)
        self.drop()
        if held is not None:
            self.state, self.ids, self.slots = held.state, held.ids, held.slots
            self.prompt_len, self.media, self.same_media = held.prompt_len, held.media, held.same_media
            self.owned, self.checkpoint = held.owned, held.checkpoint
        self._turn: tuple[list[int], tuple[int, int]] | None = None
        self._ran = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    @property
    def prefilled(self) -> bool:
        """Whether this turn's prompt ran (the cache then holds it, and :attr:`ids` are its ids)."""
        return self._ran and self.state is not None

    # ---- turns --------------------------------------------------------------------------------------------
    def next_turn(self, ids: list[int], media: tuple[int, int]) -> None:
        """The next prompt: its token ids and how many images and videos it holds."""
        self._turn, self._ran = (ids, media), False

    def end_turn(self, reply: list[int]) -> Held | None:
        """The reply generated after the prompt (its ids follow the prompt's in the cache).

        Returns:
            What the cache holds now, in a cache of its own (a batch row's copied out of its store), or ``None``
            when this turn never prefilled (the cache is then not this turn's).
        """
        ran, self._turn, self._ran = self._ran, None, False
        if not ran or self.state is None:
            return None
        self.ids = self.ids + reply
        state = dataclasses.replace(self.state, cache=standalone(self.state.cache))
        return Held(state, self.ids, self.slots, self.prompt_len, self.media, checkpoint=self.checkpoint)

    def drop(self) -> None:
        """Forget the cache: the next prompt is prefilled afresh."""
        self.state, self.ids, self.slots = None, [], torch.zeros(0, dtype=torch.long)
        self.prompt_len, self.media, self.same_media, self.owned = 0, (0, 0), True, True
        self.checkpoint: Checkpoint | None = None

    # ---- the prefills the engine calls --------------------------------------------------------------------
    def prefill(
        self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None = None, **options: Any
    ) -> Prefill:
        """:meth:`VLMAdapter.prefill` of the turn's prompt (same arguments), run from where the cache stops
        matching it."""
        ids, media = self._current()
        start = self._resume(ids, len(ids) - 1)
        run = self.adapter.run_positions(inputs, keep, start).cpu()
        if start == 0:
            prefill = self.adapter.prefill(inputs, keep=keep, **options)
            self.state = prefill.state
        else:
            given = None if keep is None else run
            prefill = self.adapter.extend(self.state, inputs, start, self.media, keep=given, **options)
            self.state = prefill.state
        self._ran_prompt(ids, media, run)
        self.checkpoint = checkpoint(self.state.cache)
        return prefill

    def prefill_soft(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        rope_delta: torch.Tensor,
        target: DecodeState | None = None,
    ) -> DecodeState:
        """An EDD draft's soft prompt: ``hidden`` ``[n, D]`` holds the target's states of the prompt's last ``n``
        positions (those the target ran); the cache keeps what it shares with the prompt before them. ``target``:
        the target's state (a multi-token drafter reads its keys, and keeps no cache of its own to resume)."""
        if self.adapter.mtp_draft:
            self.state = self.adapter.prefill_soft(hidden, position_ids, rope_delta, target=target)
            return self.state
        ids, media = self._current()
        first = len(ids) - hidden.shape[0]
        start = self._resume(ids, first)
        self.state = self.adapter.prefill_soft(
            hidden, position_ids, rope_delta, state=self.state if start > 0 else None, target=target
        )
        self._ran_prompt(ids, media, torch.arange(first, len(ids)))
        return self.state

    # ---- the prefix -----------------------------------------------------------------------------------------
    def _current(self) -> tuple[list[int], tuple[int, int]]:
        if self._turn is None:
            raise RuntimeError("TurnCache.prefill outside a turn: call next_turn(ids, media) first")
        return self._turn

    def _resume(self, ids: list[int], limit: int) -> int:
        """Keep the cache slots of the longest prefix shared with ``ids`` (at most ``limit`` positions), drop the
        rest; the first position to run (0: prefill afresh)."""
        if self.state is None:
            return 0
        shared = reusable_prefix(self.ids, ids, limit, self.placeholders, self.same_media)
        if _visual(ids[:shared], self.placeholders) < _visual(self.ids, self.placeholders):
            self.media = (0, 0)  # the text before the held media only
        positions = self._positions()
        kept = int((positions < shared).sum())
        if not can_cut_back(self.state.cache, kept):  # a hybrid model's: back to its prompt's end, or afresh
            saved = self.checkpoint
            kept = saved.length if saved is not None and saved.length <= kept else 0
            if kept:
                self.state = dataclasses.replace(self.state, cache=restore(self.state.cache, saved))
                self.owned = True
        if kept == 0:
            self.drop()
            return 0
        if self.owned:
            truncate(self.state.cache, kept)
        else:  # lent by a prefix cache or a request decoding beside this one: copy what is kept
            self.state = dataclasses.replace(self.state, cache=copy_cache(self.state.cache, kept))
            self.owned = True
        self.slots = positions[:kept]
        start = int(positions[kept - 1]) + 1
        # Visual tokens a pruned draft left out between its kept slots and the shared prefix's end stay out.
        if _visual(ids[start:shared], self.placeholders):
            start = shared
        return start

    def _positions(self) -> torch.Tensor:
        """``[length]`` logical position of every cache slot."""
        reply = self.state.length - self.slots.shape[0]
        return torch.cat([self.slots, torch.arange(self.prompt_len, self.prompt_len + reply)])

    def _ran_prompt(self, ids: list[int], media: tuple[int, int], run: torch.Tensor) -> None:
        self.slots = torch.cat([self.slots, run])
        self.ids, self.prompt_len, self.media, self._ran = ids, len(ids), media, True
        self.state.visual_tokens = int(_placeholders(ids, self.placeholders)[self.slots].sum())


class PrefixCache:
    """Finished requests' KV caches, kept for later requests that start the same way (see the module docstring).

    Assign one to a pipeline (``pipe.prefix_cache = PrefixCache()``): every call, batch and server request then
    reuses it. Thread-safe.

    Args:
        max_bytes: the most memory the entries hold (their caches and media tensors); ``None``: no bound.
        max_entries: the most entries kept; ``None``: no bound.

    Raises:
        InvalidInputError: a bound that is not a non-negative integer or ``None``.
    """

    def __init__(self, max_bytes: int | None = 2**30, max_entries: int | None = None) -> None:
        for name, value in (("max_bytes", max_bytes), ("max_entries", max_entries)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise InvalidInputError(
                    f"PrefixCache({name}={value!r}) is invalid: use an integer >= 0, or None for no bound"
                )
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self._entries: list[_Entry] = []  # least recently used first
        self._live: weakref.WeakSet[PrefixTurn] = weakref.WeakSet()  # requests decoding now
        self._lock = threading.RLock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Memory the entries hold (caches and media tensors), in bytes."""
        with self._lock:
            return sum(entry.nbytes for entry in self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def turn(self, inputs: dict[str, Any], adapter: VLMAdapter, batch: Any = None) -> PrefixTurn | None:
        """One request's caches: from the entry sharing the longest prefix with its prompt ``inputs`` (processor
        outputs, batch 1), copied, or empty. ``adapter``: the target's. ``None`` when the prompt's media cannot be
        counted (inputs built outside the pipeline without their per-prompt counts): it is then not cached.

        ``batch`` identifies the batch the request decodes in (any object its requests share): the prompts of
        that batch's requests still decoding count as entries too, so that requests sharing a prefix need not end
        one after the other to share it. Only the same batch's: its requests run one at a time, so their caches do
        not change while they are copied."""
        ids = inputs["input_ids"][0].tolist()
        try:
            (counts,) = adapter.media_counts(inputs, torch.ones_like(inputs["input_ids"], dtype=torch.bool))
        except (InvalidInputError, NotImplementedError):
            return None
        # The media as this prompt has them: a caller may write other pixels into its tensors later.
        media = {key: tensor.clone() for key, tensor in adapter.media_rows(inputs).items()}
        placeholders = adapter.visual_token_ids()
        with self._lock:
            live = [turn.prompt_entry() for turn in self._live if batch is not None and turn.batch is batch]
            entry, same = self._best(ids, media, adapter, torch.tensor(placeholders, dtype=torch.long), live)
            # A store of one entry (a chat) hands it over: the request's own will replace it.
            owned = entry is not None and self.max_entries == 1 and any(e is entry for e in self._entries)
            if owned:
                self._entries.remove(entry)
            lent = {} if entry is None else entry.held
            taken = {order: dataclasses.replace(h, same_media=same, owned=owned) for order, h in lent.items()}
            turn = PrefixTurn(self, ids, tuple(counts), media, placeholders, taken, batch)
            self._live.add(turn)
        return turn

    def _best(
        self,
        ids: list[int],
        media: dict[str, torch.Tensor],
        adapter: VLMAdapter,
        placeholders: torch.Tensor,
        live: Sequence[_Entry | None] = (),
    ) -> tuple[_Entry | None, bool]:
        """The entry (or ``live`` prompt) of the target ``adapter`` sharing the longest reusable prefix with
        ``ids`` (the most recently used of those sharing as much; an entry is moved to most recently used), if
        any, and whether ``media`` start with its media."""
        best, best_shared, best_same = None, 0, True
        for entry in [*reversed(self._entries), *(e for e in live if e is not None)]:
            if entry.held[TARGET].source() is not adapter:
                continue
            same = _extends(entry.media, media)
            shared = reusable_prefix(entry.held[TARGET].ids, ids, len(ids) - 1, placeholders, same)
            if shared > best_shared:
                best, best_shared, best_same = entry, shared, same
        if best is not None and any(entry is best for entry in self._entries):
            self._entries.remove(best)
            self._entries.append(best)
        return best, best_same

    def _fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be kept: a bigger one than the bound would push out every other
        entry, then itself."""
        return self.max_bytes is None or nbytes <= self.max_bytes

    def _put(self, entry: _Entry) -> None:
        """Keep ``entry``; drop those it makes useless (same media, ids a prefix of its), then the least recently
        used while over the bounds."""
        ids = entry.held[TARGET].ids
        with self._lock:
            self._entries = [e for e in self._entries if not _subsumed(e, entry, ids)]
            self._entries.append(entry)
            while self._entries and self._over():
                self._entries.pop(0)

    def _over(self) -> bool:
        too_many = self.max_entries is not None and len(self._entries) > self.max_entries
        return too_many or (self.max_bytes is not None and self.nbytes > self.max_bytes)


class PrefixTurn:
    """One request's :class:`TurnCache` views, from the entry it took; :meth:`end` keeps what they hold."""

    def __init__(
        self,
        store: PrefixCache,
        ids: list[int],
        counts: tuple[int, int],
        media: dict[str, torch.Tensor],
        placeholders: Sequence[int],
        taken: dict[int, Held],
        batch: Any = None,
    ) -> None:
        self.store, self.ids, self.counts, self.media = store, ids, counts, media
        self.placeholders, self.taken, self.batch = placeholders, taken, batch
        self.views: dict[int, TurnCache] = {}
        self.sources: dict[int, weakref.ref] = {}  # each view's model's adapter

    def models(self, models: Callable[[VLMAdapter, int], Any]) -> Callable[[VLMAdapter, int], TurnCache]:
        """``models`` (the adapters as the request sees them, by order) with this request's caches on top."""

        def view(adapter: VLMAdapter, order: int) -> TurnCache:
            held = self.taken.get(order)
            held = held if held is not None and held.source() is adapter else None  # another pipeline's draft
            cache = TurnCache(models(adapter, order), self.placeholders, held)
            cache.next_turn(self.ids, self.counts)
            self.views[order], self.sources[order] = cache, weakref.ref(adapter)
            return cache

        return view

    def prompt_entry(self) -> _Entry | None:
        """What this request's caches hold of its prompt while it decodes, as an entry to copy from (``None``
        before the target prefilled it, or once its batch row was given up)."""
        held = {
            order: Held(
                view.state,
                view.ids,
                view.slots,
                view.prompt_len,
                view.media,
                self.sources[order],
                checkpoint=view.checkpoint,
            )
            for order, view in self.views.items()
            if view.prefilled and in_use(view.state.cache)
        }
        return _Entry(held, self.media, 0) if TARGET in held else None

    def end(self, reply: list[int]) -> None:
        """The request ended with ``reply``: keep its caches as an entry (once the target's is there, and when
        the entry fits the store's bound; sized before anything is copied)."""
        with self.store._lock:
            self.store._live.discard(self)
        views = {order: view for order, view in self.views.items() if view.prefilled}
        nbytes = sum(cache_nbytes(v.state.cache) for v in views.values()) + sum(
            t.nbytes for t in self.media.values()
        )
        if TARGET not in views or not self.store._fits(nbytes):
            return
        held = {order: view.end_turn(reply) for order, view in views.items()}
        held = {order: dataclasses.replace(h, source=self.sources[order]) for order, h in held.items()}
        self.store._put(_Entry(held, self.media, nbytes))


def reusable_prefix(
    held: Sequence[int], ids: Sequence[int], limit: int, placeholders: torch.Tensor, same_media: bool = True
) -> int:
    """How many leading positions of ``ids`` a cache holding ``held`` can give (at most ``limit``): their common
    prefix when it holds all of ``held``'s images and videos and the prompt has the same media (``same_media``),
    else as much of it as comes before ``held``'s first image or video."""
    n = min(len(held), len(ids), limit)
    shared = next((i for i in range(n) if held[i] != ids[i]), n)
    if same_media and _visual(ids[:shared], placeholders) == _visual(held, placeholders):
        return shared
    visual = _placeholders(held, placeholders).nonzero()
    return min(shared, int(visual[0]) if visual.numel() else len(held))


def _subsumed(old: _Entry, new: _Entry, ids: list[int]) -> bool:
    """Whether ``new`` gives every request at least what ``old`` gives: same media, ``old``'s ids a prefix of its."""
    old_ids = old.held[TARGET].ids
    same_media = old.media.keys() == new.media.keys() and all(
        torch.equal(old.media[k], new.media[k]) for k in old.media
    )
    return same_media and old_ids == ids[: len(old_ids)]


def _visual(ids: Sequence[int], placeholders: torch.Tensor) -> int:
    """How many of ``ids`` are visual placeholders."""
    return int(_placeholders(ids, placeholders).sum())


def _placeholders(ids: Sequence[int], placeholders: torch.Tensor) -> torch.Tensor:
    """``[len(ids)]`` bool: the visual placeholders among ``ids``."""
    return torch.isin(torch.as_tensor(list(ids), dtype=torch.long), placeholders)


def _extends(held: dict[str, torch.Tensor], media: dict[str, torch.Tensor]) -> bool:
    """Whether ``media`` starts with ``held`` unchanged, value for value: a request may only add media after the
    ones a cache holds. A medium edited in place, replaced by other pixels, removed, or sampled otherwise (other
    frames of the same video: a new window or ``num_frames``) breaks it, whatever the token ids say."""
    for key, old in held.items():
        new = media.get(key)
        if new is None or new.dim() != old.dim():
            return False
        if old.dim() == 0:
            if not torch.equal(new, old):
                return False
            continue
        count = old.shape[0]
        if new.shape[1:] != old.shape[1:] or new.shape[0] < count or not torch.equal(new[:count], old):
            return False
    return True
