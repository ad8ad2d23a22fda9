"""transformers' own logits processors over a token tree, node by node: every processor ``generate()`` would run.

The processors most checkpoints turn on (repetition penalty, minimum lengths, suppressed tokens) are tensor ops over
the whole tree (:mod:`vlmspec.processors`). When a call needs one of the others — n-gram bans
(``no_repeat_ngram_size``), ``bad_words_ids``, ``sequence_bias``, ``forced_eos_token_id``,
``exponential_decay_length_penalty``, ``remove_invalid_values``, the prompt-side ``encoder_*`` ones, or the
caller's own ``logits_processor`` / ``prefix_allowed_tokens_fn`` given to ``pipe.generate`` — the target's own
``_get_logits_processor`` builds ``generate()``'s whole list (the same processors in the same order under the same
conditions; the sampling warpers left out, :mod:`vlmspec.sampling` applies them after), and each tree node's
logits go through it as a batch-of-one ``generate()`` step sends them: with the node's sequence (the prompt, the
tokens so far, the node's path below the root) as ``input_ids``.

Why one node at a time rather than the tree as a batch: a processor may hold per-prompt tensors built for a batch
of one (the ``encoder_*`` ones hold the prompt as ``[1, L]``; ``prefix_allowed_tokens_fn`` is called with the batch
row), so a batch of one is the only shape every processor is built for. The cost is one pass of the list per node
(a 30-node tree: 30 where ``generate()`` makes one per token), paid only while such a processor is on. Processors
must be functions of ``(input_ids, scores)``, as ``generate()``'s are: one that keeps state from call to call would
see each node's sequence as if it came next.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList

from .errors import InputTypeError, InvalidInputError
from .tree import TokenTree

TRANSFORMERS_PROCESSORS: dict[str, Callable[[Any], bool]] = {
    "sequence_bias": lambda v: bool(v),
    "no_repeat_ngram_size": lambda v: bool(v) and v > 0,
    "bad_words_ids": lambda v: bool(v),
    "forced_eos_token_id": lambda v: v is not None,
    "remove_invalid_values": lambda v: v is True,
    "exponential_decay_length_penalty": lambda v: v is not None,
    "encoder_repetition_penalty": lambda v: v is not None and v != 1,
    "encoder_no_repeat_ngram_size": lambda v: bool(v) and v > 0,
}
"""``generation_config`` settings that turn on a processor the tensor path does not implement (when each is on)."""


def setting_is_on(name: str, is_on: Callable[[Any], bool], value: Any) -> bool:
    """``is_on(value)`` for the ``generate()`` setting ``name``.

    Raises:
        InputTypeError: a value of a type the setting cannot take (``no_repeat_ngram_size="3"``), naming it.
    """
    try:
        return bool(is_on(value))
    except TypeError as err:
        raise InputTypeError(
            f"{name}={value!r:.80} is invalid: not a value generate() takes for {name} ({err}); see "
            "transformers.GenerationConfig"
        ) from err


def needs_node_processors(generation_config: Any, custom: Any = None) -> bool:
    """Whether a call needs :class:`NodeProcessing`: its own processors (``custom``, a
    :class:`~vlmspec.requests.CallHooks`), or a setting of :data:`TRANSFORMERS_PROCESSORS` on in
    ``generation_config``."""
    has_own = custom is not None and (
        bool(custom.logits_processor) or custom.prefix_allowed_tokens_fn is not None
    )
    return has_own or any(
        setting_is_on(name, is_on, getattr(generation_config, name, None))
        for name, is_on in TRANSFORMERS_PROCESSORS.items()
    )


@dataclass(frozen=True)
class NodeProcessing:
    """``generate()``'s processor list for one call, run node by node (module docstring).

    Attributes:
        model: the target, whose ``_get_logits_processor`` builds the list.
        generation_config: the call's, its call-level settings (penalty, minimum length, EOS) written in.
        max_new_tokens: the call's length (``generate()`` sets ``max_length`` from it, which forced EOS reads).
        custom: the call's own processors (:class:`~vlmspec.requests.CallHooks`), if any.
    """

    model: Any
    generation_config: Any
    max_new_tokens: int
    custom: Any = None

    def __post_init__(self) -> None:
        """Build the list once on a stand-in prompt, so that a value transformers' processors refuse is refused
        before any model work, naming the settings (the list for the request itself is built by :meth:`start`).

        Raises:
            InvalidInputError: a value one of the processors refuses.
        """
        try:
            self.start(torch.zeros(1, dtype=torch.long), 0)
        except (TypeError, ValueError) as err:
            on = [
                n for n, is_on in TRANSFORMERS_PROCESSORS.items() if is_on(getattr(self.generation_config, n))
            ]
            raise InvalidInputError(
                f"generate()'s logits processors refuse these settings ({', '.join(on) or 'the call own'}): {err}"
            ) from err

    def start(self, prompt_ids: torch.Tensor, vocab_size: int) -> NodeLogits:
        """The list for one request whose prompt is ``prompt_ids`` ``[L]`` (``vocab_size``: unused, the processors
        size themselves from the logits)."""
        ids = prompt_ids[None]  # [1, L]
        config = copy.deepcopy(self.generation_config)
        defaults = getattr(config, "_get_default_generation_params", dict)()  # as generate() fills unset ones
        for name, value in defaults.items():
            if getattr(config, name, None) is None:
                setattr(config, name, value)
        config.do_sample = False  # no warpers: vlmspec.sampling applies them
        config.renormalize_logits = False  # after the warpers: vlmspec.scores applies it
        config.max_length = ids.shape[1] + self.max_new_tokens  # as generate()'s _prepare_generated_length
        if config.min_new_tokens is not None:
            config.min_length = ids.shape[1] + config.min_new_tokens
        self.model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=ids.device)
        custom = self.custom
        fn = None if custom is None else custom.prefix_allowed_tokens_fn
        processors = self.model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=ids.shape[1],
            encoder_input_ids=ids,
            prefix_allowed_tokens_fn=None if fn is None else (lambda _, sequence: fn(custom.row, sequence)),
            logits_processor=LogitsProcessorList(() if custom is None else custom.logits_processor),
            device=ids.device,
            model_kwargs={"attention_mask": torch.ones_like(ids)},
        )
        return NodeLogits(processors, ids)


class NodeLogits:
    """:class:`NodeProcessing` over one request's growing sequence (the same three calls as
    :class:`~vlmspec.processors.SequenceLogits`)."""

    def __init__(self, processors: LogitsProcessorList, ids: torch.Tensor) -> None:
        self.processors = processors
        self.ids = ids  # [1, L + emitted]: the prompt and every token emitted so far

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's processed logits ``[V]`` (of ``[V]``)."""
        return self._run(self.ids, logits)

    def tree(self, logits: torch.Tensor, tree: TokenTree, generated: int) -> torch.Tensor:
        """Processed logits ``[N+1, V]`` of a verification's ``[N+1, V]``: each node's with its own sequence, the
        tokens so far (the root the last of them) then its path below the root (``generated``: unused, the
        sequence holds them)."""
        n = tree.tokens.shape[0]
        host = torch.cat([tree.parents, tree.tokens]).tolist()  # the tree's shape, one sync
        parents, tokens = host[:n], host[n:]
        paths: list[list[int]] = [[]]
        for node in range(1, n):  # parents come before their children
            paths.append(paths[parents[node]] + [tokens[node]])
        rows = [
            self._run(torch.cat([self.ids, self.ids.new_tensor(path)[None]], dim=1), logits[node])
            for node, path in enumerate(paths)
        ]
        return torch.stack(rows)

    def commit(self, tokens: torch.Tensor) -> None:
        """Add emitted tokens ``[k]`` to the sequence."""
        self.ids = torch.cat([self.ids, tokens.reshape(1, -1).to(self.ids)], dim=1)

    def _run(self, ids: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """One node's ``[V]`` logits through the list, as ``generate()`` runs a batch of one (a copy: some
        processors write into the scores they are given).

        Raises:
            InvalidInputError: a processor that returned other than one row (one built for a whole batch).
        """
        out = self.processors(ids, row[None].float().clone())
        if out.shape != (1, row.shape[-1]):
            raise InvalidInputError(
                f"the logits processors returned scores of shape {tuple(out.shape)} for one sequence's [1, "
                f"{row.shape[-1]}]: vlmspec runs each tree node as a batch of one (vlmspec.node_processors), so a "
                "processor must act row by row (not hold per-batch-row tensors)"
            )
        return out[0]
