"""``generate()``'s logits processors that depend on the sequence, applied to every node of a token tree.

``generate()`` runs the target's logits through processors before it picks a token, greedy or sampled
(transformers 5.x ``GenerationMixin._get_logits_processor``), and several real checkpoints turn some on in their
``generation_config`` (Qwen2-VL and Qwen2.5-VL Instruct ship ``repetition_penalty=1.05``). Speculative output is
the target's own only if every verified node sees the same processed logits ``generate()`` would have computed at
that point of the sequence. For a tree node the sequence is the prompt, the tokens generated so far and the node's
path from the root, so the processors here take the path into account:

* **repetition penalty** (``RepetitionPenaltyLogitsProcessor``): the logit of every token already in the node's
  sequence, prompt included, is divided by the penalty (multiplied when negative);
* **minimum length** (``MinLengthLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``): EOS ids get ``-inf``
  while the node's sequence is shorter than ``min_length`` / holds fewer than ``min_new_tokens`` new tokens;
* **suppressed tokens** (``SuppressTokensLogitsProcessor``, ``SuppressTokensAtBeginLogitsProcessor``): ``-inf``
  everywhere, or at the first new token only;
* OpenAI's and vLLM's **presence and frequency penalties and logit bias** (:class:`OccurrencePenalties`, not
  ``generate()``'s): after the repetition penalty, each token's logit loses ``presence_penalty`` if the node's new
  tokens hold it and ``frequency_penalty`` per time they do (the prompt does not count), then gains its bias. The
  reply is the target's own under those logits: ``generate()`` with a processor doing the same after its own.

Logits are turned to float32 first, as ``generate()`` does; the sampling warpers (:mod:`vlmspec.sampling`, all of
``generate()``'s) come after. A call that turns on any of ``generate()``'s other processors (n-gram bans, bad words,
sequence bias, forced EOS, ...) or brings its own runs transformers' whole list over the tree instead, a depth
or a node at a time (:mod:`vlmspec.node_processors`; ``forced_bos_token_id`` too, which acts on a one-token
prompt). Settings with which ``generate()`` decodes otherwise than by processors (beams, contrastive search,
...) are refused by name, rather than silently decoding something ``generate()`` would not;
``renormalize_logits`` changes neither an argmax nor a softmax (only the scores returned, :mod:`vlmspec.scores`),
so it is let through.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import InputTypeError, InvalidInputError
from .node_processors import NodeProcessing, needs_node_processors, setting_is_on
from .tree import TokenTree

REFUSED_SETTINGS: dict[str, Callable[[Any], bool]] = {
    "guidance_scale": lambda v: v is not None and v != 1,
    "watermarking_config": lambda v: v is not None,
    "num_beams": lambda v: v is not None and v > 1,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "penalty_alpha": lambda v: v is not None and v > 0,
    "dola_layers": lambda v: v is not None,
    "token_healing": lambda v: v is True,
}
"""Settings with which ``generate()`` decodes otherwise, which vlmspec does not implement: classifier-free guidance
(a second, unconditional forward), watermarking (after the warpers), beam search, several sequences per prompt,
contrastive search, DoLa and token healing (it rewrites the prompt)."""


@dataclass(frozen=True)
class OccurrencePenalties:
    """OpenAI's presence and frequency penalties and logit bias (module docstring).

    Attributes:
        presence: subtracted once from the logit of each token the new tokens hold.
        frequency: subtracted per time the new tokens hold it.
        bias: ``(token id, value)`` pairs added to those tokens' logits.
    """

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def for_call(
        cls, presence: Any, frequency: Any, logit_bias: Any, vocab_size: int
    ) -> OccurrencePenalties | None:
        """The call's ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` (``{token id: value}``),
        checked; ``None`` when they change nothing.

        Raises:
            InputTypeError: a value that is not a number, or a ``logit_bias`` that is not a mapping.
            InvalidInputError: a number that is not finite, or a token id outside the ``vocab_size`` ids.
        """
        for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
            _check_finite(name, value, "(0 is none)")
        bias = {} if logit_bias is None else logit_bias
        if not isinstance(bias, Mapping):
            raise InputTypeError(f"logit_bias={logit_bias!r:.60} is invalid: use a dict of token id -> value")
        for token, value in bias.items():
            if (
                not isinstance(token, numbers.Integral)
                or isinstance(token, bool)
                or not 0 <= token < vocab_size
            ):
                raise InvalidInputError(
                    f"logit_bias has the key {token!r:.40}: use token ids, integers from 0 to {vocab_size - 1}"
                )
            _check_finite(f"logit_bias[{token}]", value, "(added to that token's logit)")
        pairs = tuple((int(t), float(v)) for t, v in sorted(bias.items()) if v != 0)
        if presence == 0 and frequency == 0 and not pairs:
            return None
        return cls(float(presence), float(frequency), pairs)


def _check_finite(name: str, value: Any, what: str) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InputTypeError(f"{name}={value!r:.40} is invalid: use a finite number {what}")
    if not math.isfinite(value):
        raise InvalidInputError(f"{name}={value!r:.40} is invalid: use a finite number {what}")


@dataclass(frozen=True)
class LogitsProcessing:
    """The sequence-dependent processors of one call, resolved as ``generate()`` resolves them.

    Attributes:
        repetition_penalty: > 0; 1.0 is off.
        min_length: EOS is banned while prompt + new tokens are fewer (0: off).
        min_new_tokens: EOS is banned while the new tokens are fewer; when set (0 included) it takes precedence
            over ``min_length``, as in ``generate()`` (``None``: unset).
        suppress_tokens: ids that never win.
        begin_suppress_tokens: ids that cannot be the first new token.
        forced_bos_token_id: the first new token of a one-token prompt (``ForcedBOSTokenLogitsProcessor``: it acts
            only there, so on a VLM prompt never).
        eos_token_ids: the ids the minimum lengths ban.
        occurrence: OpenAI's presence and frequency penalties and logit bias, if any.
    """

    repetition_penalty: float = 1.0
    min_length: int = 0
    min_new_tokens: int | None = None
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    forced_bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    occurrence: OccurrencePenalties | None = None

    def __post_init__(self) -> None:
        penalty = self.repetition_penalty
        if not (isinstance(penalty, numbers.Real) and not isinstance(penalty, bool) and penalty > 0):
            raise InvalidInputError(
                f"repetition_penalty={penalty!r} is invalid: use a number > 0 (1.0 is no penalty; above 1 "
                "discourages repeats)"
            )
        object.__setattr__(self, "repetition_penalty", float(penalty))
        for name in ("min_length", "min_new_tokens"):
            value = getattr(self, name)
            if name == "min_new_tokens" and value is None:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"{name}={value!r} is invalid: use an integer >= 0 (0 is no minimum)")

    @classmethod
    def for_call(
        cls,
        generation_config: Any,
        eos_token_ids: Sequence[int],
        repetition_penalty: float | None = None,
        min_new_tokens: int | None = None,
        model: Any = None,
        max_new_tokens: int = 0,
        custom: Any = None,
        occurrence: OccurrencePenalties | None = None,
    ) -> LogitsProcessing | NodeProcessing | None:
        """A call's processors: its arguments over the target's ``generation_config``; ``None`` when none is on.
        Where the config turns on another of ``generate()``'s processors or the call brings its own (``custom``, a
        :class:`~vlmspec.requests.CallHooks`),
        ``model``'s whole list over the tree (:class:`~vlmspec.node_processors.NodeProcessing`, ``max_new_tokens``
        the call's length).

        Raises:
            InvalidInputError: a value out of range, or a setting that turns on a processor of ``generate()`` that
                vlmspec does not implement, named with how to turn it off.
        """
        for name, is_on in REFUSED_SETTINGS.items():
            value = getattr(generation_config, name, None)
            if setting_is_on(name, is_on, value):
                raise InvalidInputError(
                    f"the generation_config sets {name}={value!r} (the target's, or the one passed to "
                    f"pipe.generate), a generate() setting vlmspec does not apply, so its output would not be "
                    f"generate()'s; set pipe.target.generation_config.{name} = None (or {name}=None in the call) to "
                    "decode without it"
                )

        def setting(name: str, given: Any, default: Any) -> Any:
            value = given if given is not None else getattr(generation_config, name, None)
            return default if value is None else value

        processing = cls(
            repetition_penalty=setting("repetition_penalty", repetition_penalty, 1.0),
            min_length=setting("min_length", None, 0),
            min_new_tokens=setting("min_new_tokens", min_new_tokens, None),
            suppress_tokens=tuple(setting("suppress_tokens", None, ())),
            begin_suppress_tokens=tuple(setting("begin_suppress_tokens", None, ())),
            forced_bos_token_id=setting("forced_bos_token_id", None, None),
            eos_token_ids=tuple(eos_token_ids),
            occurrence=occurrence,
        )
        if model is not None and needs_node_processors(generation_config, custom):
            if occurrence is not None:
                raise InvalidInputError(
                    "presence_penalty, frequency_penalty and logit_bias cannot be combined with the generate() "
                    "logits processors this generation_config turns on (no_repeat_ngram_size, bad_words_ids, "
                    "sequence_bias, ...): turn those off, or give the penalties as a processor of your own to "
                    "pipe.generate(logits_processor=...)"
                )
            config = copy.deepcopy(generation_config)
            config.repetition_penalty, config.min_new_tokens = (
                processing.repetition_penalty,
                processing.min_new_tokens,
            )
            config.eos_token_id = list(processing.eos_token_ids) or None
            return NodeProcessing(model, config, max_new_tokens, custom)
        return processing if processing.is_on else None

    @property
    def is_on(self) -> bool:
        """Whether any processor changes logits."""
        least = self.min_length if self.min_new_tokens is None else self.min_new_tokens
        bans_eos = least > 0 and bool(self.eos_token_ids)
        return (
            self.repetition_penalty != 1.0
            or bans_eos
            or bool(self.suppress_tokens or self.begin_suppress_tokens)
            or self.forced_bos_token_id is not None
            or self.occurrence is not None
        )

    def start(self, prompt_ids: torch.Tensor, vocab_size: int) -> SequenceLogits:
        """The processors of one request whose prompt is ``prompt_ids`` ``[L]``, over ``vocab_size`` logits."""
        return SequenceLogits(self, prompt_ids, vocab_size)


class SequenceLogits:
    """:class:`LogitsProcessing` over one request's growing sequence: which tokens it holds (for the penalty) and
    how many are new (for the minimum lengths). :meth:`commit` adds each step's emitted tokens."""

    def __init__(self, processing: LogitsProcessing, prompt_ids: torch.Tensor, vocab_size: int) -> None:
        device = prompt_ids.device
        self.processing = processing
        self.vocab_size = vocab_size
        # ids at or above the LM head's size cannot be generated: they map to one extra column, dropped after use
        self.seen = _columns(prompt_ids, vocab_size)  # [V+1]
        # new tokens before EOS may end the reply: a given min_new_tokens takes precedence over min_length, as
        # generate() makes it (min_length = prompt + min_new_tokens)
        least, prompt_len = processing.min_new_tokens, prompt_ids.shape[0]
        self.forced_bos = processing.forced_bos_token_id if prompt_len == 1 else None
        self.eos_until = processing.min_length - prompt_len if least is None else least
        # [V] bool masks, each applied as one masked fill (a calibrated pair suppresses ~150k padded ids)
        self.eos = _mask(processing.eos_token_ids, vocab_size, device)
        self.suppress = _mask(processing.suppress_tokens, vocab_size, device)
        self.begin = _mask(processing.begin_suppress_tokens, vocab_size, device)
        occurrence = processing.occurrence
        # [V+1] float: how many times the new tokens hold each id (OpenAI's penalties count those only)
        self.counts = torch.zeros(vocab_size + 1, device=device) if occurrence is not None else None
        self.bias: torch.Tensor | None = None  # [V] float
        biased = [(t, v) for t, v in occurrence.bias if t < vocab_size] if occurrence is not None else []
        if biased:  # ids past the LM head's width cannot be generated: ignored, as the masks ignore them
            ids, values = zip(*biased, strict=True)
            self.bias = torch.zeros(vocab_size, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's processed logits ``[V]`` (of ``[V]``): the first new token's."""
        counts = None if self.counts is None else self.counts[None, : self.vocab_size]
        out = self._apply(
            logits[None].float(),
            self.seen[None, : self.vocab_size],
            logits.new_zeros(1, dtype=torch.long),
            counts,
        )
        if self.forced_bos is not None:  # generate()'s list forces it before it suppresses
            out = torch.full_like(out, float("-inf"))
            out[:, self.forced_bos] = 0.0
            if self.suppress is not None:
                out = out.masked_fill(self.suppress, float("-inf"))
        if self.begin is not None:
            out = out.masked_fill(self.begin, float("-inf"))
        return out[0]

    def tree(self, logits: torch.Tensor, tree: TokenTree, generated: int) -> torch.Tensor:
        """Processed logits ``[N+1, V]`` of a verification's ``[N+1, V]``: each node's with the sequence it ends
        (the ``generated`` new tokens so far, the root the last of them, then the node's path below the root)."""
        held, counts = self.seen[None], None  # [1, V+1]
        n = tree.tokens.shape[0]
        penalized = self.processing.repetition_penalty != 1.0
        if penalized or self.counts is not None:
            path_ids = torch.where(tree.ancestors, tree.tokens[None], self.vocab_size)  # [N+1, N+1]
            path_ids = path_ids.clamp(max=self.vocab_size)
        if penalized:
            held = held.expand(n, -1).clone().scatter_(1, path_ids, True)
        if self.counts is not None:  # the root is the last token emitted: counted already
            below_root = path_ids[:, 1:]  # [N+1, N]
            counts = self.counts[None].expand(n, -1).clone()
            counts.scatter_add_(1, below_root, (below_root < self.vocab_size).float())
            counts = counts[:, : self.vocab_size]
        return self._apply(logits.float(), held[:, : self.vocab_size], generated + tree.depths, counts)

    def commit(self, tokens: torch.Tensor) -> None:
        """Add emitted tokens ``[k]`` to the sequence."""
        ids = tokens.clamp(max=self.vocab_size)
        self.seen[ids] = True
        if self.counts is not None:
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))

    def _apply(
        self, logits: torch.Tensor, held: torch.Tensor, new_tokens: torch.Tensor, counts: torch.Tensor | None
    ) -> torch.Tensor:
        """``logits`` ``[n, V]`` float32, ``held`` ``[n or 1, V]`` bool, ``new_tokens`` ``[n]`` long: the new tokens
        each row's sequence holds; ``counts`` ``[n, V]`` float: how many times they hold each id (with
        :attr:`LogitsProcessing.occurrence`)."""
        penalty = self.processing.repetition_penalty
        if penalty != 1.0:
            penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(held, penalized, logits)
        occurrence = self.processing.occurrence
        if counts is not None:
            logits = logits - occurrence.frequency * counts - occurrence.presence * (counts > 0).float()
        if self.bias is not None:
            logits = logits + self.bias
        if self.eos is not None and self.eos_until > 0:
            short = (new_tokens < self.eos_until)[:, None]  # [n, 1]
            logits = logits.masked_fill(short & self.eos, float("-inf"))
        if self.suppress is not None:
            logits = logits.masked_fill(self.suppress, float("-inf"))
        return logits


def _mask(ids: tuple[int, ...], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """``[V]`` bool, true at ``ids`` (ids at or above ``vocab_size`` cannot be generated: ignored, as
    transformers' processors ignore them); ``None`` for no ids."""
    if not ids:
        return None
    return _columns(torch.tensor(ids, dtype=torch.long, device=device), vocab_size)[:vocab_size]


def _columns(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[V+1]`` bool, true at ``ids`` ``[k]``, every id at or above ``vocab_size`` in the one extra column."""
    mask = torch.zeros(vocab_size + 1, dtype=torch.bool, device=ids.device)
    mask[ids.clamp(max=vocab_size)] = True
    return mask
