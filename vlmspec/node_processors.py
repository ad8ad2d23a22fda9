"""transformers' own logits processors over a token tree, a tree depth at a time where they act row by row.

The processors most checkpoints turn on (repetition penalty, minimum lengths, suppressed tokens) are tensor ops over
the whole tree (:mod:`vlmspec.processors`). When a call needs one of the others — n-gram bans
(``no_repeat_ngram_size``), ``bad_words_ids``, ``sequence_bias``, ``forced_eos_token_id``,
``exponential_decay_length_penalty``, ``remove_invalid_values``, the prompt-side ``encoder_*`` ones, or the
caller's own ``logits_processor`` / ``prefix_allowed_tokens_fn`` given to ``pipe.generate`` — the target's own
``_get_logits_processor`` builds ``generate()``'s whole list (the same processors in the same order under the same
conditions; the sampling warpers left out, :mod:`vlmspec.sampling` applies them after), and each tree node's
logits go through it with the node's sequence (the prompt, the tokens so far, the node's path below the root)
as ``input_ids``, as a ``generate()`` step sends a row's.

Batched by depth: the nodes of one tree depth ``d`` end sequences of the same length ``L + d``, so where every
processor of the list computes each row from that row's ``input_ids`` and scores alone (:func:`is_row_wise`:
an allowlist of transformers classes, :data:`ROW_WISE`, each read in its source) and the call brings no
processor of its own, the list runs once per depth, with that depth's ``n_d`` nodes as one batch
``[n_d, L + d]``: for a tree of 30 nodes below the root, 5 deep, 6 passes rather than 31, each row the same
numbers a batch of one gives (the same elementwise, gather and scatter ops per row).

The prompt-side ``encoder_*`` processors are on the list too: they hold the one prompt as ``[1, L]`` and read the
rows of a batch as beams of it, which is what a depth's nodes are (every node continues the one prompt).

Node by node otherwise, a batch of one per node, the only shape every processor is built for:
``PrefixConstrainedLogitsProcessor`` reads the rows as groups of ``num_beams`` per prompt and calls the
caller's function with the group's batch id, and a caller's own processors are code vlmspec cannot read, which
may assume one row (even an instance of an allowlisted class may hold tensors per row of the caller's batch).
The cost is one pass of the list per node (a 30-node tree: 31 where ``generate()`` makes one per token), paid
only while such a processor is on. Either way processors must be functions of ``(input_ids, scores)``, as
``generate()``'s are: one that keeps state from call to call would see each node's sequence as if it came
next.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import torch
from transformers import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

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


ROW_WISE: frozenset[type] = frozenset(
    {
        MinLengthLogitsProcessor,  # bans EOS by input_ids.shape[-1], one length for a depth's rows
        MinNewTokensLengthLogitsProcessor,  # the same, less the prompt's length
        RepetitionPenaltyLogitsProcessor,  # gather/scatter of each row at its own ids (see is_row_wise)
        NoRepeatNGramLogitsProcessor,  # each row's n-gram windows matched against its own last n-1 ids
        SequenceBiasLogitsProcessor,  # each row's last ids matched against the biased prefixes (built from V)
        NoBadWordsLogitsProcessor,  # SequenceBiasLogitsProcessor with -inf biases
        ForcedBOSTokenLogitsProcessor,  # acts by input_ids.shape[-1] alone, on every row alike
        ForcedEOSTokenLogitsProcessor,  # the same
        SuppressTokensAtBeginLogitsProcessor,  # the same
        SuppressTokensLogitsProcessor,  # elementwise over the scores
        InfNanRemoveLogitsProcessor,  # elementwise over the scores
        ExponentialDecayLengthPenalty,  # by input_ids.shape[-1] and each row's own EOS scores
        EncoderRepetitionPenaltyLogitsProcessor,  # the one prompt's ids, the same for every row (rows as beams)
        EncoderNoRepeatNGramLogitsProcessor,  # each row's last ids against the one prompt's n-grams (rows as beams)
    }
)
"""transformers processors (exact classes: a subclass may override ``__call__``) whose ``__call__`` computes
each row of the scores from that row's ``input_ids`` and scores alone (read in transformers'
``logits_process.py``), so that a batch of a depth's nodes gives each node the row a batch of one would."""


def is_row_wise(processor: Any) -> bool:
    """Whether ``processor`` is of a :data:`ROW_WISE` class and built without per-row data (a
    ``RepetitionPenaltyLogitsProcessor`` whose ``prompt_ignore_length`` is a tensor holds one entry per batch
    row, and refuses another number of rows)."""
    if type(processor) is RepetitionPenaltyLogitsProcessor:
        return not isinstance(processor.prompt_ignore_length, torch.Tensor)
    return type(processor) in ROW_WISE


def node_paths(tree: TokenTree) -> list[list[int]]:
    """Each node's tokens below the root, ``N+1`` host lists (the root's empty; node ``i``'s of length
    ``depths[i]``), read with one device sync."""
    n = tree.tokens.shape[0]
    host = torch.cat([tree.parents, tree.tokens]).tolist()
    parents, tokens = host[:n], host[n:]
    paths: list[list[int]] = [[]]
    for node in range(1, n):  # parents come before their children
        paths.append(paths[parents[node]] + [tokens[node]])
    return paths


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
    """``generate()``'s processor list for one call, run on the tree a depth at a time where every processor
    is :func:`is_row_wise` and the call brings none of its own, else node by node (module docstring).

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
        """The list for one request whose prompt is ``prompt_ids`` ``[L]`` (``vocab_size``: unused, the
        processors size themselves from the logits), and whether it may run a depth at a time (module
        docstring).

        Built with no attention mask: the prompt's mask of ones would give the repetition penalty a ``[1]``
        tensor of no tokens to skip (``generate()`` skips a row's left padding), which skips nothing, as no
        mask does, but which refuses a batch of other than one row."""
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
        )
        own = custom is not None and bool(custom.logits_processor)
        return NodeLogits(processors, ids, by_depth=not own and all(is_row_wise(p) for p in processors))


class NodeLogits:
    """:class:`NodeProcessing` over one request's growing sequence (the same three calls as
    :class:`~vlmspec.processors.SequenceLogits`).

    Attributes:
        processors: the request's list.
        ids: ``[1, L + emitted]``, the prompt and every token emitted so far.
        by_depth: run a tree's nodes a depth at a time (the list is row-wise), else one node at a time.
    """

    def __init__(self, processors: LogitsProcessorList, ids: torch.Tensor, by_depth: bool = False) -> None:
        self.processors = processors
        self.ids = ids
        self.by_depth = by_depth

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """The prefill's processed logits ``[V]`` (of ``[V]``; a copy: some processors write into the scores
        they are given)."""
        return self._run(self.ids, logits[None].float().clone())[0]

    def tree(self, logits: torch.Tensor, tree: TokenTree, generated: int) -> torch.Tensor:
        """Processed logits ``[N+1, V]`` (float32) of a verification's ``[N+1, V]``: each node's with its own
        sequence, the tokens so far (the root the last of them) then its path below the root (``generated``:
        unused, the sequence holds them)."""
        paths = node_paths(tree)
        if self.by_depth:
            return self._depth_by_depth(logits, paths)
        rows = [
            self._run(self._sequences([path]), logits[node][None].float().clone())
            for node, path in enumerate(paths)
        ]
        return torch.cat(rows)

    def commit(self, tokens: torch.Tensor) -> None:
        """Add emitted tokens ``[k]`` to the sequence."""
        self.ids = torch.cat([self.ids, tokens.reshape(1, -1).to(self.ids)], dim=1)

    def _depth_by_depth(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """:meth:`tree` with one pass of the list per depth: the ``n_d`` nodes of depth ``d`` as a batch
        ``[n_d, L + d]`` (``paths``: :func:`node_paths`). Returns ``[N+1, V]`` float32 in node order."""
        order = sorted(range(len(paths)), key=lambda node: len(paths[node]))  # stable: a depth's nodes adjoin
        index = None if order == list(range(len(order))) else torch.tensor(order, device=logits.device)
        # [N+1, V] in depth order (drafted level by level: already), a copy the processors may write into
        scores = logits.to(torch.float32, copy=True) if index is None else logits[index].float()
        rows, start = [], 0
        for _, group in groupby(order, key=lambda node: len(paths[node])):
            nodes = list(group)
            end = start + len(nodes)
            rows.append(self._run(self._sequences([paths[node] for node in nodes]), scores[start:end]))
            start = end
        done = torch.cat(rows)
        if index is None:
            return done
        out = torch.empty_like(done)
        out[index] = done
        return out

    def _sequences(self, paths: list[list[int]]) -> torch.Tensor:
        """``[n, L + emitted + d]``: the sequence so far then each of ``n`` paths of one length ``d``."""
        below = self.ids.new_tensor(paths)  # [n, d], d = 0 included
        return torch.cat([self.ids.expand(len(paths), -1), below], dim=1)

    def _run(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ``[n, V]`` of ``n`` sequences ``ids`` ``[n, S]`` through the list, as ``generate()``
        runs a batch.

        Raises:
            InvalidInputError: a processor that returned another shape (one built for a batch of its own).
        """
        out = self.processors(ids, scores)
        if out.shape != scores.shape:
            rows = "one sequence's" if scores.shape[0] == 1 else f"{scores.shape[0]} sequences'"
            raise InvalidInputError(
                f"the logits processors returned scores of shape {tuple(out.shape)} for {rows} "
                f"{list(scores.shape)}: vlmspec runs each tree node's sequence as a row of its own "
                "(vlmspec.node_processors), so a processor must act row by row (not hold per-batch-row "
                "tensors)"
            )
        return out
