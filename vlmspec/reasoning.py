"""Thinking models: a reply's reasoning apart from its answer.

Qwen3-VL's *Thinking* checkpoints (and DeepSeek-R1-style models) reason before they answer, between ``<think>`` and
``</think>``; their chat templates usually open the reasoning in the prompt (``...<|im_start|>assistant\\n<think>\\n``),
so the reply is ``reasoning</think>answer``. A pipeline with a :class:`ReasoningParser` (``pipe.reasoning_parser =
"qwen3"``; ``vlmspec serve --reasoning-parser qwen3``, vLLM's flag) keeps the two apart:

* ``out.reasoning`` and ``out.content`` of each reply (:func:`split_reply`); the server's ``reasoning_content``
  and ``content``, streamed apart too (:class:`ReplySplitter`). Decoding does not change: ``out.text`` is the
  whole reply, the target's own.
* Structured outputs and tool calls apply to the answer: the structure's masks start after ``</think>``, so the
  model reasons freely first (vLLM's and SGLang's behaviour with a reasoning parser; :mod:`vlmspec.structured`).

Where the parsers leave it open, decided as vLLM's ``qwen3`` parser does (and said here):

* **Does the reply open in reasoning?** Yes, unless the prompt already closed it: its last think tag is ``</think>``
  (a Qwen3 template with ``enable_thinking=False`` writes an empty ``<think>\\n\\n</think>`` into the prompt), or the
  call's ``chat_template_kwargs`` say ``enable_thinking=False`` (as vLLM's ``qwen3`` parser reads them, for templates
  that write no tag then). Then the whole reply is the answer and a structure applies from its first token. A prompt with no tag at all opens
  the reply in reasoning too (DeepSeek-R1 starts reasoning without a tag): a parser is for thinking models only.
* **A ``<think>`` the model writes itself** (older templates), after optional whitespace at the reply's start, is
  dropped; one anywhere else is text.
* **No ``</think>`` in the reply** (cut by ``max_tokens``, or EOS while reasoning): all of it is reasoning, the
  answer is empty.

``qwen3`` and ``deepseek_r1`` (vLLM's names) are both ``<think>`` ... ``</think>``; another model's tags are
``ReasoningParser("name", start, end)``. Tags are matched in the text, so a tokenizer that spells them in several
tokens works for splitting; a structure after the reasoning needs ``</think>`` to be one token of the vocabulary
(as in every thinking model's tokenizer), since the masks switch on at that token. An end tag that is a *special*
token (one ``skip_special_tokens`` drops from the reply's text) is refused when the parser is set: the text could
not be split at it (Qwen3's and DeepSeek-R1's tags are ordinary added tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InputTypeError, InvalidInputError
from .validation import did_you_mean

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


@dataclass(frozen=True)
class ReasoningParser:
    """How a thinking model marks its reasoning: between ``start`` and ``end``.

    Attributes:
        name: what it is called (``--reasoning-parser``).
        start: the tag that opens the reasoning.
        end: the tag that closes it; what follows is the answer.
    """

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        for field in ("name", "start", "end"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise InvalidInputError(
                    f"ReasoningParser {field}={value!r} is invalid: give a non-empty string"
                )

    def opens_reasoning(self, prompt: str) -> bool:
        """Whether a reply to ``prompt`` (its text, special tokens kept) starts inside the reasoning: unless the
        prompt's last tag is :attr:`end`."""
        return prompt.rfind(self.end) < 0 or prompt.rfind(self.start) > prompt.rfind(self.end)

    def end_token(self, tokenizer: Any) -> int:
        """The id of :attr:`end` as one token of ``tokenizer``.

        Raises:
            InvalidInputError: ``tokenizer`` spells it in several tokens (or not at all).
        """
        token = _vocabulary_id(tokenizer, self.end)  # an entry of its own, whatever encode() would prefix
        if token is not None:
            return token
        ids = tokenizer.encode(self.end, add_special_tokens=False)
        if len(ids) != 1:
            raise InvalidInputError(
                f"structured outputs after reasoning need the reasoning parser {self.name!r}'s end tag {self.end!r} "
                f"to be one token, but this tokenizer spells it in {len(ids)} ({ids}); use a thinking model's "
                "tokenizer, or leave out the reasoning parser to apply the structure from the reply's first token"
            )
        return ids[0]


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1"),
}
"""The parsers known by name (vLLM's names for the same tags)."""
NO_PARSER = "none"
"""The name that sets no parser: a reply is all content (it drops a saved pipeline's parser, where ``None`` keeps it)."""
PARSER_NAMES: tuple[str, ...] = (*REASONING_PARSERS, NO_PARSER)
"""Every name a command line or config takes for the reasoning parser."""


def reasoning_parser(parser: str | ReasoningParser | None) -> ReasoningParser | None:
    """``parser`` by name (:data:`REASONING_PARSERS`), as it is, or ``None`` (for ``None`` or :data:`NO_PARSER`).

    Raises:
        InvalidInputError: an unknown name, with the known ones.
        InputTypeError: neither a name nor a :class:`ReasoningParser`.
    """
    if parser is None or isinstance(parser, ReasoningParser):
        return parser
    if parser == NO_PARSER:
        return None
    if isinstance(parser, str) and parser in REASONING_PARSERS:
        return REASONING_PARSERS[parser]
    named = isinstance(parser, str)
    raise (InvalidInputError if named else InputTypeError)(
        f"reasoning_parser={parser!r:.60} is not a parser{did_you_mean(parser, REASONING_PARSERS) if named else ''}: "
        f"use a name ({', '.join(REASONING_PARSERS)}), {NO_PARSER!r} for none, or ReasoningParser(name, start, end) "
        "for other tags"
    )


class ParserAttribute:
    """The descriptor of ``VLMSpecPipeline.reasoning_parser``: a name is looked up (:func:`reasoning_parser`) where
    it is assigned, so that a bad one is refused there, not at the next call; ``None`` until one is set."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attribute = f"_{name}"

    def __get__(self, pipe: Any, owner: type | None = None) -> Any:
        return self if pipe is None else getattr(pipe, self.attribute, None)

    def __set__(self, pipe: Any, value: str | ReasoningParser | None) -> None:
        parser = reasoning_parser(value)
        token = None if parser is None else _vocabulary_id(pipe.tokenizer, parser.end)
        if token is not None and not pipe.tokenizer.decode([token], skip_special_tokens=True):
            raise InvalidInputError(
                f"reasoning_parser {parser.name!r}: its end tag {parser.end!r} is a special token of this tokenizer, "
                "which replies are decoded without (skip_special_tokens), so no reply could be split at it; vlmspec "
                "splits at tags the text keeps (Qwen3's and DeepSeek-R1's are)"
            )
        setattr(pipe, self.attribute, parser)


def _vocabulary_id(tokenizer: Any, tag: str) -> int | None:
    """The id of ``tag`` as one entry of ``tokenizer``'s vocabulary, or ``None``."""
    token = tokenizer.convert_tokens_to_ids(tag)
    return token if isinstance(token, int) and token != tokenizer.unk_token_id else None


def split_reply(parser: ReasoningParser | None, text: str) -> tuple[str | None, str]:
    """``text``, a whole reply, as ``(reasoning, content)``: ``(None, text)`` when the reply does not open in
    reasoning (``parser`` is ``None``: see :func:`reply_reasoning`), else the text before ``parser.end`` (a
    ``parser.start`` the reply starts with dropped) and after it (``""`` when there is none)."""
    if parser is None:
        return None, text
    stripped = text.lstrip()
    if stripped.startswith(parser.start):
        text = stripped[len(parser.start) :]
    reasoning, _, content = text.partition(parser.end)
    return reasoning, content


class ReplySplitter:
    """:func:`split_reply` as the reply streams (``parser``: :func:`reply_reasoning`'s): :meth:`feed` takes each new piece of text and gives the
    reasoning and content it adds, :meth:`finish` what was held back. The pieces each side gives join to that side
    of :func:`split_reply` on the whole text, however the text is cut into pieces: text that may still turn out to
    be a tag (a prefix of ``</think>`` at the end, whitespace before a possible ``<think>`` at the start) is held
    back until the next piece decides it."""

    def __init__(self, parser: ReasoningParser | None) -> None:
        self.parser = parser
        self.phase = "content" if parser is None else "start"
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """``(reasoning, content)`` that ``piece`` adds (either may be ``""``)."""
        if self.phase == "content":
            return "", piece
        parser, self.held = self.parser, self.held + piece
        if self.phase == "start":
            stripped = self.held.lstrip()
            if stripped.startswith(parser.start):
                self.held, self.phase = stripped[len(parser.start) :], "reasoning"
            elif parser.start.startswith(stripped):
                return "", ""  # whitespace, or the start tag's beginning: not decided yet
            else:
                self.phase = "reasoning"
        reasoning, found, content = self.held.partition(parser.end)
        if found:
            self.held, self.phase = "", "content"
            return reasoning, content
        keep = _partial_tag(self.held, parser.end)
        reasoning, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return reasoning, ""

    def finish(self) -> str:
        """The reasoning held back when the reply ends (none once it reached its content)."""
        held, self.held = self.held, ""
        return held


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is the beginning of ``tag`` (shorter than it)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def reply_reasoning(
    parser: ReasoningParser | None,
    tokenizer: Any,
    prompt_ids: Sequence[int] | torch.Tensor,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ReasoningParser | None:
    """``parser`` when a reply to the prompt ``prompt_ids`` (made with the chat template's ``template_kwargs``) opens
    in its reasoning (see the module's docstring), else ``None``: what :func:`split_reply` and
    :class:`ReplySplitter` take."""
    if parser is None or (template_kwargs or {}).get("enable_thinking") is False:
        return None
    ids = (
        prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
    )  # ``[L]`` (a tensor's too)
    prompt = tokenizer.decode(ids, skip_special_tokens=False)
    return parser if parser.opens_reasoning(prompt) else None


__all__ = [
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReplySplitter",
    "reasoning_parser",
    "reply_reasoning",
    "split_reply",
]
