"""Conversations that keep their KV caches: each turn prefills only what the earlier turns did not.

    chat = pipe.chat(system="You describe pictures.", max_new_tokens=256)
    chat.send("What is in it?", images=image)   # SpecOutput; chat.messages now holds both turns
    chat.send("And what colour is it?")          # prefills this turn's few tokens, not the image again

Each turn's prompt is the whole history through the chat template, exactly what ``generate()`` on
``chat.messages`` gets; the reply is the target's own, token for token (greedy). What is kept between turns is
each model's KV cache, as the prefix it is (prefix caching, as vLLM and SGLang do it):

* A cache knows the token ids of the logical positions it holds: the last prompt and the reply generated after
  it. The next prompt keeps the longest common prefix of those ids and its own, drops the rest of the cache, and
  runs only from there (:meth:`~vlmspec.models.VLMAdapter.extend`): the new turn, its images and videos through
  the vision tower, and the reply's last token (generated, never fed back). Comparing token ids rather than
  counting messages keeps reuse exact whatever the template does with an assistant turn (Qwen3-VL's drops
  thinking, some templates re-tokenise the reply text differently from the generated ids).
* Positions come from the whole new prompt each turn (M-RoPE ``rope_delta`` included), so the run positions sit
  where a fresh prefill puts them.
* The cache is dropped and the prompt prefilled afresh when the history it holds was edited (``chat.messages``
  changed before its end: texts compared by their token ids, images and videos by what the processor made of
  them, pixels, grids and frame timings, so an image edited in place, another window of a video or another
  ``num_frames`` count as edits even where the placeholder tokens stay the same) or when the common prefix
  stops before one of its images or videos ends.
* The draft's cache follows the same rule on its own slots: a pruned draft keeps its earlier choices and prunes
  the new visual tokens with the target's scores of this turn; tokens the draft had not consumed when the last
  reply ended are run with the new turn. An EDD draft reads the target's hidden states of the positions the
  target runs; positions between its cache and those (the last reply's unconsumed tokens) stay out of its
  context, which only costs acceptance, never correctness (the target decides every token).

Turns decode at batch 1. A failing turn leaves the history as it was (its user message is removed) and drops
the caches.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .batching import DRAFT_FIRST, TARGET
from .cache import truncate
from .errors import InputTypeError
from .models import DecodeState, Prefill, VLMAdapter
from .requests import call_arguments

if TYPE_CHECKING:
    from .pipeline import SpecOutput, VLMSpecPipeline

_TURN_ARGUMENTS = ("image", "prompt", "video", "messages")


class TurnCache:
    """One model's KV cache across the turns of a conversation: its adapter, with prefills that reuse the cache.

    Everything but the prefills is the adapter's own. Before each turn :meth:`next_turn` gives the prompt's ids and
    media counts; after it, :meth:`end_turn` the reply.

    Args:
        adapter: the model's adapter.
        placeholders: the pair's image and video placeholder token ids.

    Attributes:
        state: the model's decoding state (``None`` before the first prefill or after :meth:`drop`).
        ids: token ids of the logical positions the cache may hold: the last prompt it prefilled, then the reply.
        slots: ``[S]`` logical positions of the cache slots the prefills wrote (all of them, or a pruned draft's
            kept ones); the slots after them hold the reply's tokens, one position each from ``prompt_len`` on.
    """

    def __init__(self, adapter: VLMAdapter, placeholders: tuple[int, ...]) -> None:
        self.adapter = adapter
        self.placeholders = torch.tensor(placeholders, dtype=torch.long)
        self.state: DecodeState | None = None
        self.ids: list[int] = []
        self.slots = torch.zeros(0, dtype=torch.long)
        self.prompt_len = 0
        self.media = (0, 0)
        self._turn: tuple[list[int], tuple[int, int]] | None = None
        self._ran = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    # ---- turns --------------------------------------------------------------------------------------------
    def next_turn(self, ids: list[int], media: tuple[int, int]) -> None:
        """The next prompt: its token ids and how many images and videos it holds."""
        self._turn, self._ran = (ids, media), False

    def end_turn(self, reply: list[int]) -> None:
        """The reply generated after the prompt (its ids follow the prompt's in the cache)."""
        if self._ran:
            self.ids = self.ids + reply
        self._turn, self._ran = None, False

    def drop(self) -> None:
        """Forget the cache: the next prompt is prefilled afresh."""
        self.state, self.ids, self.slots, self.prompt_len, self.media = None, [], self.slots[:0], 0, (0, 0)

    # ---- the prefills the engine calls --------------------------------------------------------------------
    def prefill(
        self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None = None, **options: Any
    ) -> Prefill:
        """:meth:`VLMAdapter.prefill` of the turn's prompt (same arguments), run from where the cache stops
        matching it."""
        ids, media = self._current()
        start = self._resume(ids, len(ids) - 1)
        if start == 0:
            prefill = self.adapter.prefill(inputs, keep=keep, **options)
            self.state = prefill.state
            run = torch.arange(len(ids)) if keep is None else keep.cpu()
        else:
            run = torch.arange(start, len(ids)) if keep is None else keep[keep >= start].cpu()
            given = None if keep is None else run
            prefill = self.adapter.extend(self.state, inputs, start, self.media, keep=given, **options)
        self._ran_prompt(ids, media, run)
        return prefill

    def prefill_soft(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, rope_delta: torch.Tensor
    ) -> DecodeState:
        """An EDD draft's soft prompt: ``hidden`` ``[n, D]`` holds the target's states of the prompt's last ``n``
        positions (those the target ran); the cache keeps what it shares with the prompt before them."""
        ids, media = self._current()
        first = len(ids) - hidden.shape[0]
        start = self._resume(ids, first)
        self.state = self.adapter.prefill_soft(
            hidden, position_ids, rope_delta, state=self.state if start > 0 else None
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
        shared = _common_prefix(self.ids, ids, limit)
        # An earlier image or video not shared whole (LLaVA-OneVision tiles one image differently once a second
        # joins it): nothing before it can be kept either.
        if self._visual(ids[:shared]) != self._visual(self.ids):
            shared = 0
        positions = self._positions()
        kept = int((positions < shared).sum())
        if kept == 0:
            self.drop()
            return 0
        truncate(self.state.cache, kept)
        self.slots = positions[:kept]
        start = int(positions[kept - 1]) + 1
        if self._visual(ids[start:shared]):  # the gap is visual tokens a pruned draft left out: they stay out
            start = shared
        return start

    def _positions(self) -> torch.Tensor:
        """``[length]`` logical position of every cache slot."""
        reply = self.state.length - self.slots.shape[0]
        return torch.cat([self.slots, torch.arange(self.prompt_len, self.prompt_len + reply)])

    def _ran_prompt(self, ids: list[int], media: tuple[int, int], run: torch.Tensor) -> None:
        self.slots = torch.cat([self.slots, run])
        self.ids, self.prompt_len, self.media, self._ran = ids, len(ids), media, True
        self.state.visual_tokens = int(self._placeholders(ids)[self.slots].sum())

    def _visual(self, ids: list[int]) -> int:
        """How many of ``ids`` are visual placeholders."""
        return int(self._placeholders(ids).sum())

    def _placeholders(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids)]`` bool: the visual placeholders among ``ids``."""
        return torch.isin(torch.tensor(ids, dtype=torch.long), self.placeholders)


class Chat:
    """A conversation with a pipeline: ``send`` a user turn, get the reply; both models' caches carry over.

    Create one with :meth:`VLMSpecPipeline.chat`; see the module docstring for how the caches are reused.

    Attributes:
        messages: the history in transformers' chat format (system, user and assistant turns). You may edit it;
            the next turn then prefills afresh from the first change (from the start when the change comes
            before an image or video the caches hold).
        options: default keyword arguments of every turn (:meth:`VLMSpecPipeline.__call__`'s, such as
            ``max_new_tokens``, ``do_sample``, ``stop_strings``); :meth:`send` may override them.
    """

    def __init__(self, pipe: VLMSpecPipeline, system: str | None = None, **options: Any) -> None:
        _check_options(options)
        call_arguments(inspect.signature(type(pipe).__call__), options)  # a mistyped option fails here, named
        if system is not None and not isinstance(system, str):
            raise InputTypeError(
                f"pipe.chat(system=...) must be a string (the system prompt), got {system!r}"
            )
        self.pipe = pipe
        self.options = options
        self.messages: list[dict[str, Any]] = []
        if system is not None:
            self.messages.append(system_turn(system))
        draft = pipe._draft_adapter
        placeholders = pipe._target_adapter.visual_token_ids()  # the draft's too: one vocabulary
        self._caches = {TARGET: TurnCache(pipe._target_adapter, placeholders)}
        if draft is not None:
            self._caches[DRAFT_FIRST] = TurnCache(draft, placeholders)
        self._held_media: dict[str, torch.Tensor] = {}  # the processed media the caches hold (_media_tensors)

    def send(
        self,
        text: str,
        images: Any = None,
        video: Any = None,
        **options: Any,
    ) -> SpecOutput:
        """Add a user turn (``images``: one or a list; ``video``: a path or frames), generate the reply, add it.

        ``options`` override :attr:`options` for this turn (``streamer=...`` streams it).

        Returns:
            The reply as :class:`~vlmspec.pipeline.SpecOutput`; ``stats.cached_prompt_tokens`` says how much of the
            prompt came from the caches.
        """
        _check_options(options)
        if not isinstance(text, str):
            raise InputTypeError(f"chat.send: text must be a string, got {type(text).__name__}")
        listed = images if isinstance(images, (list, tuple)) else ([] if images is None else [images])
        content = [{"type": "image", "image": image} for image in listed]
        content += [{"type": "video", "video": video}] if video is not None else []
        self.messages.append({"role": "user", "content": [*content, {"type": "text", "text": text}]})
        try:
            out = self._reply({**self.options, **options})
        except BaseException:
            self.messages.pop()
            self._drop()
            raise
        self.messages.append({"role": "assistant", "content": [{"type": "text", "text": out.text}]})
        return out

    def _reply(self, options: dict[str, Any]) -> SpecOutput:
        """Steps of one turn: prepare the prompt, check the media the caches hold, decode with the turn caches."""
        pipe = self.pipe
        call = pipe._prepare({**options, "messages": self.messages})
        media = _media_tensors(call.inputs)
        if not _extends(self._held_media, media):  # a medium edited, removed or sampled otherwise
            self._drop()
        ids = call.inputs["input_ids"][0].tolist()
        kinds = [kind for kind, _ in _media(self.messages)]
        for cache in self._caches.values():
            cache.next_turn(ids, (kinds.count("image"), kinds.count("video")))
        with pipe.kernels():
            out = pipe._decode(call, pipe.batch_policy(1), 0, lambda adapter, order: self._caches[order])
        for cache in self._caches.values():
            cache.end_turn(out.token_ids)
        self._held_media = media
        return out

    def _drop(self) -> None:
        for cache in self._caches.values():
            cache.drop()
        self._held_media = {}


def system_turn(text: str) -> dict[str, Any]:
    """The system message a chat starts with, as a list of parts: templates render a plain string differently
    (LLaVA-OneVision's puts no newline before it), so code comparing with a chat must write it this way too."""
    return {"role": "system", "content": [{"type": "text", "text": text}]}


def _check_options(options: dict[str, Any]) -> None:
    wrong = sorted(set(options) & set(_TURN_ARGUMENTS))
    if wrong:
        raise InputTypeError(
            f"chat options {', '.join(wrong)} are not per-chat settings: give a turn's text, images and video to "
            "chat.send(text, images=..., video=...)"
        )


def _media_tensors(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The processed media of a prompt's processor outputs: every tensor but the per-token ones (``input_ids``'
    shape), i.e. pixels, grids, sizes, frame timings, one row (or patch) per medium along dim 0, in prompt order."""
    shape = inputs["input_ids"].shape
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape != shape}


def _extends(held: dict[str, torch.Tensor], media: dict[str, torch.Tensor]) -> bool:
    """Whether ``media`` starts with ``held`` unchanged, value for value: a turn may only add media after the
    ones the caches hold. A medium edited in place, replaced by other pixels, removed, or sampled otherwise (other
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


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _media(messages: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """``(type, source)`` of the images and videos in ``messages``, in order."""
    found = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) or not isinstance(content, Sequence):
            continue
        for item in content:
            if isinstance(item, dict) and item.get("type") in ("image", "video"):
                source = next(
                    (item[k] for k in ("image", "video", "url", "path") if item.get(k) is not None), None
                )
                found.append((item["type"], source))
    return found
