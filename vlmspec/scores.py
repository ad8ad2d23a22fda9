"""The target's distribution behind each new token, as ``generate(output_logits=True, output_scores=True)`` returns it.

Speculative decoding computes it anyway: the verification forward gives the target's logits at every tree node,
and the logits at an accepted node are the target's next-token logits after that prefix, the ones a plain decoding
step would compute (up to floating-point differences of a wider forward). A :class:`ScoreLog` keeps the rows of the
nodes each step emits from: the raw logits (``output_logits``) and the scores ``generate()`` chooses from
(``output_scores``: its logits processors, then, when sampling, the warpers, then a log-softmax where the
config's ``renormalize_logits`` asks for it, as ``generate()``'s ``LogitNormalization`` ends its list).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InputTypeError, InvalidInputError
from .sampling import SamplingParams


@dataclass
class TokenScores:
    """The target's next-token distribution for each new token (``T`` new tokens, ``V`` vocabulary).

    Attributes:
        logits: ``[T, V]`` float32, the target's raw logits (``generate()``'s ``output_logits``).
        scores: ``[T, V]`` float32, after ``generate()``'s logits processors and, when sampling, its warpers
            (``output_scores``): what the token was chosen from.
    """

    logits: torch.Tensor
    scores: torch.Tensor


class ScoreLog:
    """Collects :class:`TokenScores` row by row as a decoding emits tokens.

    Args:
        sampling: the request's sampling settings (their warpers turn processed logits into scores), ``None`` for
            greedy decoding.
        renormalize: log-softmax the scores last (``generation_config.renormalize_logits``).
    """

    def __init__(self, sampling: SamplingParams | None, renormalize: bool = False) -> None:
        self._warpers = sampling.warpers() if sampling is not None else None
        self._renormalize = renormalize
        self._logits: list[torch.Tensor] = []
        self._scores: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, processed: torch.Tensor) -> None:
        """Keep ``[n, V]`` raw ``logits`` and the ``[n, V]`` ``processed`` logits of the nodes ``n`` new tokens were
        chosen from."""
        scores = processed.to(torch.float32, copy=True)
        if self._warpers is not None:
            scores = self._warpers(None, scores)
        if self._renormalize:
            scores = scores.log_softmax(dim=-1)
        self._logits.append(logits.to(torch.float32, copy=True))
        self._scores.append(scores)

    def keep(self, count: int) -> None:
        """Drop the rows after the first ``count`` (a step's tokens after the one a stop condition ended on)."""
        kept = 0
        for i, rows in enumerate(self._scores):
            if kept + rows.shape[0] >= count:
                cut = count - kept
                self._logits[i:] = [self._logits[i][:cut]]
                self._scores[i:] = [rows[:cut]]
                return
            kept += rows.shape[0]

    def steps(self) -> tuple[torch.Tensor, ...]:
        """The scores kept so far as ``generate()`` hands them to stopping criteria: one ``[1, V]`` per token."""
        return tuple(torch.cat(self._scores).split(1))

    def result(self) -> TokenScores:
        """The ``[T, V]`` rows kept, in the order of the tokens."""
        return TokenScores(logits=torch.cat(self._logits), scores=torch.cat(self._scores))


def check_output_scores(value: object) -> bool:
    """``pipe(output_scores=...)``: a bool.

    Raises:
        InputTypeError: anything else, naming the value.
    """
    if not isinstance(value, bool):
        raise InputTypeError(
            f"output_scores={value!r:.80} is invalid: use True (keep the target's logits and scores of each new "
            "token in output.scores) or False"
        )
    return value


def generate_steps(rows: Sequence[TokenScores], field: str, width: int, pad: int) -> tuple[torch.Tensor, ...]:
    """``generate()``'s ``scores``/``logits`` tuples for a batch: one ``[B, V]`` tensor per step, ``width`` steps.

    A row that stopped before ``width`` tokens has no distribution for its later (padded) positions: they hold
    ``-inf`` with 0 at ``pad`` (the pad token is certain there, as ``generate()`` forces it; all ``-inf`` for a
    pad id beyond the logits), where ``generate()`` has the target's scores of a step it computed for the finished
    row and then discarded.

    Args:
        rows: each row's :class:`TokenScores` (``[T_b, V]``, ``T_b <= width``).
        field: ``"scores"`` or ``"logits"``.
        width: new tokens in the output (the longest row's).
        pad: the pad token id.
    """
    tables = [getattr(row, field) for row in rows]
    filler = torch.full_like(tables[0][0], float("-inf"))
    if 0 <= pad < filler.shape[0]:
        filler[pad] = 0.0
    return tuple(
        torch.stack([table[t] if t < table.shape[0] else filler for table in tables]) for t in range(width)
    )


@torch.inference_mode()
def continuation_logits(
    model: torch.nn.Module, inputs: Mapping[str, Any], token_ids: Sequence[int]
) -> torch.Tensor:
    """The model's raw next-token logits before each of ``token_ids``, given the prompt ``inputs``: one forward over
    the prompt and the continuation (teacher forcing), the logits ``generate()`` would compute one step at a time.

    Args:
        model: a ``*ForConditionalGeneration`` model.
        inputs: one prompt's processor outputs (``input_ids`` ``[1, L]``), on the model's device.
        token_ids: the continuation's ``n`` token ids (at least one).

    Returns:
        ``[n, V]`` float32: row ``i`` is the distribution ``token_ids[i]`` was drawn from.

    Raises:
        ValueError: no token ids.
    """
    tokens = continuation_ids(token_ids)
    ids = inputs["input_ids"]  # [1, L]
    new = torch.tensor([tokens], dtype=ids.dtype, device=ids.device)  # [1, n]
    batch = dict(inputs, input_ids=torch.cat([ids, new], dim=1))  # [1, L + n]
    for key, fill in _PER_TOKEN_INPUTS.items():  # they grow with the text
        if torch.is_tensor(inputs.get(key)):
            batch[key] = torch.cat([inputs[key], torch.full_like(new, fill, dtype=inputs[key].dtype)], dim=1)
    # the logits of the last n + 1 positions only: the prompt's last predicts token 0, the continuation's last none
    # (cut here too: a model whose forward takes no logits_to_keep, VideoLLaMA3's, gives every position's)
    out = model(**batch, logits_to_keep=len(tokens) + 1, use_cache=False)
    return out.logits[0, -len(tokens) - 1 : -1].float()  # [n, V]


@torch.inference_mode()
def greedy_logits(
    model: torch.nn.Module, inputs: Mapping[str, Any], max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own greedy ``generate()`` on ``inputs`` and the raw logits each new token was chosen from.

    Args:
        model: a ``*ForConditionalGeneration`` model (its ``generation_config`` says where a row stops).
        inputs: processor outputs of a batch of prompts (``input_ids`` ``[B, L]``, left-padded when ``B > 1``), on
            the model's device.
        max_new_tokens: the most new tokens.

    Returns:
        ``(new, logits)``: ``[B, T]`` new token ids (a row that stopped early is padded to the longest's ``T``)
        and ``[B, T, V]`` float32 logits (``generate()``'s ``output_logits``).
    """
    out = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[:, inputs["input_ids"].shape[1] :], torch.stack(out.logits, dim=1).float()


def continuation_ids(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """``token_ids`` (a sequence or a 1-D tensor) as a list of at least one id.

    Raises:
        ValueError: none, or a tensor that is not 1-D (naming its shape).
    """
    if torch.is_tensor(token_ids) and token_ids.dim() != 1:
        raise InvalidInputError(
            f"token_ids has shape {tuple(token_ids.shape)}; give one continuation's ids, [n] (a row of a batch)"
        )
    tokens = token_ids.tolist() if torch.is_tensor(token_ids) else list(token_ids)
    if not tokens:
        raise InvalidInputError("token_ids is empty: give the continuation's token ids (at least one)")
    return tokens


_PER_TOKEN_INPUTS = {"attention_mask": 1, "mm_token_type_ids": 0, "token_type_ids": 0}
"""Processor outputs with one entry per token, and what a continuation's text tokens hold there (attended; text,
not an image or video token)."""
