"""OpenAI's chat-completions responses from a pipeline's outputs: whole replies, stream chunks, their choices,
usage and log-probabilities (:mod:`vlmspec.openai_api` reads the requests, :mod:`vlmspec.serving` decodes them)."""

from __future__ import annotations

import functools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from .engine import SpecOutput
from .openai_tools import ToolCalling

STATS_FIELDS = ("policy", "steps", "mean_accepted", "tokens_per_step", "tokens_per_second", "total_seconds")
"""``SpecStats`` fields a response carries under ``vlmspec``."""
LOWEST_LOGPROB = -9999.0
"""What a token the distribution excludes (``-inf``) is given as: JSON has no infinity (OpenAI's value too)."""


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops`` it holds (OpenAI leaves the stop string out), and whether one was."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def finish_reason(output: SpecOutput, stopped: bool, max_tokens: int, eos_ids: tuple[int, ...]) -> str:
    """``"length"`` when the reply ran to ``max_tokens`` without an EOS or a stop string, else ``"stop"``."""
    ended = stopped or bool(output.token_ids and output.token_ids[-1] in eos_ids)
    return "length" if not ended and len(output.token_ids) >= max_tokens else "stop"


def logprobs(output: SpecOutput, tokenizer: Any, content: str, top: int) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a reply: each token of ``content`` with its log-probability under the distribution
    it was chosen from (``generate()``'s scores: after its processors and, when sampling, its warpers) and the
    ``top`` likeliest alternatives. Tokens after ``content`` (an EOS, a cut stop string) are left out."""
    scores = torch.log_softmax(output.scores.scores.float(), dim=-1).clamp(min=LOWEST_LOGPROB)  # [T, V]
    entries = []
    for k in range(_tokens_within(tokenizer, output.token_ids, content)):
        token = output.token_ids[k]
        entry = _token_entry(tokenizer, token, scores[k, token].item())
        best = torch.topk(scores[k], top)
        pairs = zip(best.indices.tolist(), best.values.tolist(), strict=True)
        entry["top_logprobs"] = [_token_entry(tokenizer, i, value) for i, value in pairs]
        entries.append(entry)
    return {"content": entries}


def _tokens_within(tokenizer: Any, ids: list[int], content: str) -> int:
    """How many of ``ids`` make up ``content``: the longest prefix whose text fits in it, special tokens ending
    it (a binary search: the text of a prefix grows with it)."""
    specials = set(tokenizer.all_special_ids)
    end = next((k for k, token in enumerate(ids) if token in specials), len(ids))
    low, high = 0, end
    while low < high:
        middle = (low + high + 1) // 2
        if len(tokenizer.decode(ids[:middle], skip_special_tokens=True)) <= len(content):
            low = middle
        else:
            high = middle - 1
    return low


def _token_entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": _token_bytes(tokenizer, token, text)}


def _token_bytes(tokenizer: Any, token: int, text: str) -> list[int]:
    """The UTF-8 bytes ``token`` stands for: its text's, or, where the token is part of a character (its text is
    U+FFFD), its bytes as a byte-level BPE vocabulary (GPT-2's, Qwen's) spells them, so that joining the tokens'
    bytes gives the character as OpenAI's ``bytes`` field promises."""
    piece = tokenizer.convert_ids_to_tokens(token)
    alphabet = _byte_alphabet()
    if "\ufffd" in text and isinstance(piece, str) and piece and all(c in alphabet for c in piece):
        return [alphabet[c] for c in piece]
    return list(text.encode())


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes: printable Latin-1 bytes as themselves, the others as ``chr(256 + i)``
    in byte order (the GPT-2 tokenizer's mapping, which Qwen's tokenizers share)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), 256),
    ]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def choice(
    index: int,
    text: str | None,
    reason: str,
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One reply of a ``chat.completion`` (its content ``text``, its tool calls when it made any, and its reasoning
    when it has any: :func:`reasoning_fields`)."""
    message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
    message.update(reasoning_fields(reasoning) if reasoning is not None else {})
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A message's (or a stream delta's) reasoning, under both names clients read: ``reasoning_content`` (vLLM's
    first, DeepSeek's API) and ``reasoning`` (vLLM's since it renamed it)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def tool_reason(reason: str, tools: ToolCalling | None, calls: list[dict[str, Any]]) -> str:
    """The finish reason of a reply that made ``calls``: ``tool_calls`` unless it was cut (``length``) or the
    request named the function (OpenAI gives ``stop`` for a forced call)."""
    if not calls or reason == "length" or (tools is not None and tools.choice not in ("auto", "required")):
        return reason
    return "tool_calls"


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``calls`` as a stream chunk's ``tool_calls``: each whole, with its ``index``."""
    return [{"index": i, **call} for i, call in enumerate(calls)]


def usage(output: SpecOutput) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt tokens taken from the server's
    prefix cache instead of prefilled (:mod:`vlmspec.prefix_cache`)."""
    prompt, completion = output.stats.prompt_tokens, len(output.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": output.stats.cached_prompt_tokens},
    }


def stats(output: SpecOutput) -> dict[str, Any]:
    return {name: getattr(output.stats, name) for name in STATS_FIELDS}


@dataclass(frozen=True)
class Reply:
    """The identity every object of one reply shares (``id``, ``created``, ``model``)."""

    model: str
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, choices: list[dict[str, Any]], outputs: list[SpecOutput]) -> dict[str, Any]:
        """The whole reply (``chat.completion``): its :func:`choice` s, made from ``outputs`` (one prompt's)."""
        tokens = usage(outputs[0])
        tokens["completion_tokens"] = sum(len(output.token_ids) for output in outputs)
        tokens["total_tokens"] = tokens["prompt_tokens"] + tokens["completion_tokens"]
        return self._object("chat.completion", choices, usage=tokens, vlmspec=stats(outputs[0]))

    def chunk(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        """One streamed piece (``chat.completion.chunk``)."""
        return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": reason}])

    def usage_chunk(self, output: SpecOutput) -> dict[str, Any]:
        """The last chunk of a stream with ``include_usage``: no choices, the usage and statistics."""
        return self._object("chat.completion.chunk", [], usage=usage(output), vlmspec=stats(output))

    def _object(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}


class StopHolder:
    """Stream text with the stop strings left out: holds back the end of the text that could begin one.

    Only the text not sent yet is kept and searched (no stop string lies wholly in what was sent), so each piece
    costs its own length and the longest stop string's, not the reply's."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The text that can be sent now that ``piece`` has come ("" after a stop string)."""
        if self.stopped:
            return ""
        cut, self.stopped = cut_at_stop(self.pending + piece, self.stops)
        end = len(cut) if self.stopped else max(0, len(cut) - self.hold)
        out, self.pending = cut[:end], cut[end:]
        return out

    def finish(self) -> str:
        """What is left to send at the end of the reply."""
        if self.stopped:
            return ""
        out, self.pending = self.pending, ""
        return out
