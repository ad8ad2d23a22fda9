"""Stop conditions applied exactly as ``generate()`` applies them for one sequence.

``generate()`` checks its criteria after each new token: it stops after ``max_new_tokens`` tokens, after an EOS
token (which is kept in the output), or once the decoded text ends with a stop string (``StopStringCriteria``:
the stop string must end inside the last token's text, and may begin in the prompt, since ``generate()`` decodes
the whole sequence). The engine emits several tokens per step and calls :meth:`StopCriteria.update` after each of
them, so it cuts the output at exactly the same token.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from transformers import MaxTimeCriteria

from .errors import InputTypeError, InvalidInputError


@dataclass
class StopCriteria:
    """Args:
    max_new_tokens: the most tokens to generate (an integer >= 1).
    eos_token_ids: tokens that end generation (kept in the output).
    stop_strings: strings that end generation once generated (one string or a list of them, as
        ``generate(stop_strings=...)`` takes; kept as a tuple).
    tokenizer: needed only with ``stop_strings`` (to decode).
    criteria: a ``generate()`` call's own ``stopping_criteria`` (callables of ``(input_ids, scores)`` returning a
        ``[1]`` bool tensor), called after each new token the length and EOS checks have not already ended, with
        the whole sequence as ``[1, L + t]`` ids on the prompt's device and the scores so far (one ``[1, V]`` per
        token) where ``criteria_scores``, else ``None``.
    criteria_scores: see ``criteria`` (``generate()`` hands them over with ``return_dict_in_generate`` and
        ``output_scores``).
    max_time: ``generate()``'s ``max_time``: seconds after ``started`` (a ``time.time()``; ``None``: when decoding
        starts, :meth:`after_prompt`) past which no further token is generated (``MaxTimeCriteria``); ``None``: no
        limit.
    started: see ``max_time`` (``pipe.generate`` gives its call's start: the limit is the call's, as in
        ``generate()``).
    prompt_ids: the prompt's tokens, where a stop string may begin and with which ``criteria`` see the sequence
        (:meth:`after_prompt` sets them).
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = None
    criteria: tuple[Any, ...] = ()
    max_time: float | None = None
    started: float | None = None
    criteria_scores: bool = False
    prompt_ids: tuple[int, ...] = ()
    device: Any = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, numbers.Integral)
            or self.max_new_tokens < 1
        ):
            raise InvalidInputError(f"max_new_tokens={self.max_new_tokens!r} is invalid: use an integer >= 1")
        self.max_new_tokens = int(self.max_new_tokens)
        self.stop_strings = stop_string_tuple(self.stop_strings)
        if self.stop_strings and self.tokenizer is None:
            raise InvalidInputError(
                "stop_strings need a tokenizer to decode the output; pass the processor's tokenizer"
            )
        self._eos = frozenset(self.eos_token_ids)
        limit = self.max_time
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, numbers.Real) or limit < 0
        ):
            raise InvalidInputError(f"max_time={limit!r} is invalid: use a number of seconds >= 0, or None")
        self._check_replaced_defaults()

    def _check_replaced_defaults(self) -> None:
        """Refuse a criterion in ``criteria`` of the type of one these settings make: ``generate()`` would use it
        instead of its own (its merge keeps the caller's of a type), which vlmspec does not mirror.

        Raises:
            InvalidInputError: naming the criterion and the argument to use instead.
        """
        made = {
            "MaxLengthCriteria": ("max_new_tokens or max_length", True),
            "EosTokenCriteria": ("eos_token_id", bool(self.eos_token_ids)),
            "StopStringCriteria": ("stop_strings", bool(self.stop_strings)),
            "MaxTimeCriteria": ("max_time", self.max_time is not None),
        }
        for criterion in self.criteria:
            argument, exists = made.get(type(criterion).__name__, ("", False))
            if exists:
                raise InvalidInputError(
                    f"stopping_criteria holds a {type(criterion).__name__}, of the type generate() makes from "
                    f"{argument}, and would use it instead of its own: pass {argument} instead (or leave it unset)"
                )

    def after_prompt(self, prompt_ids: torch.Tensor) -> StopCriteria:
        """These criteria for a request whose prompt is ``prompt_ids`` (``[L]``; read on the host only when there
        are stop strings or criteria), its decoding starting now (``max_time``)."""
        criteria = self.criteria
        if self.max_time is not None:
            criteria = (*criteria, MaxTimeCriteria(self.max_time, initial_timestamp=self.started))
        if not self.stop_strings and not criteria:
            return self
        return dataclasses.replace(
            self,
            criteria=criteria,
            max_time=None,
            prompt_ids=tuple(prompt_ids.tolist()),
            device=prompt_ids.device,
        )

    def update(self, tokens: list[int], scores: Any = None) -> bool:
        """True when generation must stop after the last token of ``tokens`` (``scores``: the request's
        :class:`~vlmspec.scores.ScoreLog` with ``output_scores``, whose rows ``criteria`` are given)."""
        if len(tokens) >= self.max_new_tokens or tokens[-1] in self._eos:
            return True
        if self.criteria:
            ids = torch.tensor([[*self.prompt_ids, *tokens]], device=self.device)
            steps = scores.steps()[: len(tokens)] if scores is not None and self.criteria_scores else None
            if any(bool(torch.as_tensor(criterion(ids, steps)).any()) for criterion in self.criteria):
                return True
        if not self.stop_strings:
            return False
        last = self.tokenizer.decode(tokens[-1:])
        longest = max(map(len, self.stop_strings))
        # Decode enough trailing tokens (of the prompt too) to cover the longest stop string plus the last token.
        tail, count, available = last, 1, len(tokens) + len(self.prompt_ids)
        # (a tail that starts inside a character decodes to U+FFFD: it grows until that character is whole)
        while (len(tail) < longest + len(last) or tail.startswith("\ufffd")) and count < available:
            count = min(2 * count, available)
            before = count - len(tokens)
            tail = self.tokenizer.decode(
                [*self.prompt_ids[-before:], *tokens] if before > 0 else tokens[-count:]
            )
        for stop in self.stop_strings:
            end = tail.rfind(stop)
            if end >= 0 and end + len(stop) > len(tail) - len(last):
                return True
        return False


def eos_token_ids(model: Any, generation_config: Any = None) -> tuple[int, ...]:
    """The EOS ids ``generate()`` stops at for ``model``: its ``generation_config``'s (or the one given), else its
    text config's."""
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    return () if eos is None else token_ids(eos, empty_ok=True)


def token_ids(value: Any, name: str = "eos_token_id", empty_ok: bool = False) -> tuple[int, ...]:
    """One token id or a sequence of them (``generate()``'s ``eos_token_id``) as a tuple of ints; an empty
    sequence only with ``empty_ok``.

    Raises:
        TypeError: anything else, named as ``name``.
    """
    ids = tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if (not ids and not empty_ok) or any(
        isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids
    ):
        raise InputTypeError(f"{name}={value!r} must be a token id or a list of them")
    if any(i < 0 for i in ids):
        raise InvalidInputError(f"{name}={value!r} is invalid: token ids are integers >= 0")
    return tuple(int(i) for i in ids)


def stop_string_tuple(value: Any) -> tuple[str, ...]:
    """``generate()``'s ``stop_strings`` (``None``, one string or a list of strings) as a tuple of strings.

    Raises:
        TypeError: anything else, named.
    """
    if value is None:
        return ()
    if isinstance(value, str):  # one string, as generate(stop_strings="...") takes it
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InputTypeError(
        f"stop_strings={value!r:.80} is invalid: use a string or a list of strings (stop_strings=['.', '\\n'])"
    )


def until_eos(tokens: list[int], eos: tuple[int, ...]) -> list[int]:
    """``tokens`` up to and including the first EOS (as ``generate()``'s output of one row reads)."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)
