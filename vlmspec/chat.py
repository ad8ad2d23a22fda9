"""Conversations that keep their KV caches: each turn prefills only what the earlier turns did not.

    chat = pipe.chat(system="You describe pictures.", max_new_tokens=256)
    chat.send("What is in it?", images=image)   # SpecOutput; chat.messages now holds both turns
    chat.send("And what colour is it?")          # prefills this turn's few tokens, not the image again

Each turn's prompt is the whole history through the chat template, exactly what ``generate()`` on
``chat.messages`` gets; the reply is the target's own, token for token (greedy). A chat is a prefix cache of one
entry (:mod:`vlmspec.prefix_cache`, whose rules keep the reuse exact): the caches of the last turn's prompt and
reply, which the next turn extends from the longest prefix its token ids (and media) share with them. Editing
``chat.messages`` before its end is allowed: the next turn then reuses what comes before the first change, or
only the text before the first image or video when the change is one or comes before one.

Turns decode at batch 1. A failing turn leaves the history as it was (its user message is removed). The chat's one
entry is handed to each turn, not copied, so a conversation holds one copy of its caches.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from .errors import InputTypeError
from .prefix_cache import PrefixCache
from .requests import call_arguments

if TYPE_CHECKING:
    from .pipeline import SpecOutput, VLMSpecPipeline

_TURN_ARGUMENTS = ("image", "prompt", "video", "messages")


class Chat:
    """A conversation with a pipeline: ``send`` a user turn, get the reply; both models' caches carry over.

    Create one with :meth:`VLMSpecPipeline.chat`; see the module docstring for how the caches are reused.

    Attributes:
        messages: the history in transformers' chat format (system, user and assistant turns). You may edit it;
            the next turn then prefills afresh from the first change (from the first image or video when the
            change is one, or comes before one).
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
        self._prefixes = PrefixCache(max_bytes=None, max_entries=1)  # the last turn's caches

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
            raise
        self.messages.append({"role": "assistant", "content": [{"type": "text", "text": out.text}]})
        return out

    def _reply(self, options: dict[str, Any]) -> SpecOutput:
        """One turn: the prompt of the whole history, decoded at batch 1 on the last turn's caches."""
        pipe = self.pipe
        call = pipe._prepare({**options, "messages": self.messages})
        with pipe.kernels():
            return pipe._decode(call, pipe.batch_policy(1), 0, lambda adapter, order: adapter, self._prefixes)


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
