"""Gemma 4's assistants (``model_type`` ``gemma4_assistant``, e.g. ``gemma-4-E2B-it-assistant``): the small drafters
Google trained for each Gemma 4 model, which draft several tokens from the target's last state (multi-token
prediction) instead of running a language model of their own over the sequence.

What one forward of the assistant reads, as transformers' ``SinglePositionMultiTokenCandidateGenerator`` feeds it:

* the input row ``[e(x), s]``: the target's (scaled) embedding of a token ``x`` and a state ``s`` of the target's
  width. For the root (the token the target just chose), ``s`` is the target's final (normed) hidden state at the
  position that chose it; for a drafted token, ``s`` is what the assistant's forward that proposed it returned
  (``last_hidden_state``, projected back to the target's width);
* the target's own keys and values: every assistant layer reuses those of the target's last layer of its kind
  (``kv_sharing_modes`` ``"store"``), over the committed sequence. The assistant keeps no cache;
* the root's position, for every token it drafts in the step.

So a token tree costs one assistant forward per level, each node a query of its own over the target's keys (each
under the mask transformers builds for its one candidate: :func:`query_masks`), and a node's children come from its
parent's returned state: :class:`vlmspec.draft.MTPDraftTree` grows it. What the engine hands over is
the target's last decoder layer output at the accepted path (the EDD plumbing), normed here as the target's model
norms it.

Choices where transformers is open, and why: the keys read are the committed ones only. After a verification,
transformers cuts the target's keys at the sequence length, which keeps the key of the first rejected candidate at
the new token's place (its key was computed in the verification); the new token has no key yet, as after the
prefill, where transformers reads the prompt's keys only. vlmspec reads the committed keys at every step, the
prefill's case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache import layer_entries, new_cache
from ..errors import InvalidInputError
from .attention import model_lock
from .base import DecodeState, VLMAdapter, config_value, layer_config

ASSISTANT_TYPES = {"gemma4_assistant": "gemma4"}
"""``model_type`` of the multi-token drafters vlmspec takes, and the family of the targets each drafts for."""


@dataclass
class AssistantState(DecodeState):
    """An assistant's decoding state: no cache of its own (``cache`` stays empty), the target's state it reads keys
    from, and the target's last committed hidden state.

    Attributes:
        target: the target's decoding state (its cache is read, never changed).
        hidden: ``[1, D]`` the target's normed final hidden state at the last committed position.
    """

    target: DecodeState | None = None
    hidden: torch.Tensor | None = None


class Gemma4AssistantAdapter(VLMAdapter):
    """The engine's handle on a Gemma 4 assistant (see the module docstring).

    Args:
        model: the ``Gemma4AssistantForCausalLM``.
        target: the target's adapter (a Gemma 4 VLM), whose embedding table, final norm and cache layers it reads.

    Raises:
        InvalidInputError: the target is not a Gemma 4 model, or the assistant was made for another width or
            another shape of keys.
    """

    reads_pictures = False
    mtp_draft = True

    def __init__(self, model: torch.nn.Module, target: VLMAdapter) -> None:
        super().__init__(model)
        check_assistant(model, target.model)
        self.target = target
        text = target.config.get_text_config()
        self.store_layers = store_layers(text)
        self.target_layers = text.num_hidden_layers

    def visual_token_ids(self) -> tuple[int, int]:
        return self.target.visual_token_ids()

    @property
    def reads_target_layer(self) -> int:
        """The target's last decoder layer: its output, normed (:meth:`root_state`), is the root's state."""
        return self.target_layers - 1

    def root_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[1, D]`` the state a root is drafted from: the target's last layer output ``hidden`` ``[1, D]`` at the
        position that chose it, through the target's final norm (transformers' ``hidden_states[-1]``)."""
        return self.target.model.model.language_model.norm(hidden)

    @torch.inference_mode()
    def prefill_soft(
        self, hidden: torch.Tensor, *_: Any, target: DecodeState | None = None, **__: Any
    ) -> AssistantState:
        """The assistant's state after the target's prefill (:meth:`EDDAdapter.prefill_soft`'s arguments): the
        target's state (``target``, whose keys it reads) and the root's state from ``hidden`` ``[n, D]``, the target's
        last layer output at the prompt positions it ran (the last one chose the first root). The rotary positions
        are the target's, and a conversation's earlier state holds nothing to keep: neither is read."""
        if target is None:
            raise InvalidInputError("a Gemma 4 assistant reads the target's keys: give the target's state")
        empty = new_cache(self.model)
        return AssistantState(empty, target.rope_delta, 0, target=target, hidden=self.root_state(hidden[-1:]))

    def probe_state(self, context: int) -> AssistantState:
        """A state over ``context`` committed tokens of zero keys (what the cost probe times the assistant on: its
        forward's cost depends on how many keys it reads, not on their values)."""
        cache = new_cache(self.target.model)
        device, dtype = self.device, self.dtype
        for index in range(max(self.store_layers.values()) + 1):
            heads, width = _key_shape(self.target.model, index)
            zeros = torch.zeros(1, heads, context, width, device=device, dtype=dtype)
            cache.update(zeros, zeros, index)
        target = DecodeState(cache, torch.zeros((), dtype=torch.long, device=device), 0)
        hidden = torch.zeros(1, self.target.config.get_text_config().hidden_size, device=device, dtype=dtype)
        return AssistantState(new_cache(self.model), target.rope_delta, 0, target=target, hidden=hidden)

    def draft_step(
        self, state: AssistantState, tokens: torch.Tensor, states: torch.Tensor, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One assistant forward for ``n`` tree nodes at once.

        Args:
            state: the assistant's state (the target's committed keys are read from ``state.target``).
            tokens: ``[n]`` the nodes' tokens.
            states: ``[n, D]`` the states they are drafted from (a root's: :meth:`root_state`; a drafted node's: its
                parent's returned state).
            position: the root's logical position (every node's, as the assistant was trained).

        Returns:
            ``[n, V]`` logits of each node's next token and ``[n, D]`` the states its children are drafted from.
        """
        return self.draft_steps([(state, tokens, states, position)])[0]

    @torch.inference_mode()
    def draft_steps(
        self, steps: list[tuple[AssistantState, torch.Tensor, torch.Tensor, int]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`draft_step` for several requests of a batch in one forward: request ``b``'s ``n_b`` nodes are row
        ``b``'s queries over its own committed keys, read in place from the target's batch store (its rows side by
        side, each at its own length: the keys past a row's length are masked); rows and queries with no node are
        padding whose outputs are dropped. One request's step reads its keys as they are (a cache of its own or a
        store row). Returns each step's ``([n_b, V], [n_b, D])``."""
        first = steps[0][0].target.cache
        merged = len(steps) > 1
        store = first.store if merged else None
        rows = [step[0].target.cache.row if merged else 0 for step in steps]  # each step's row of the batch
        batch, n = (store.rows if merged else 1), max(step[1].shape[0] for step in steps)
        lengths = store.lengths[:batch] if merged else [layer_entries(first, 0)[0].shape[2]]
        if merged:  # every row's keys as the store holds them: [B, H, max(lengths), d]
            shared = {
                kind: tuple(t[:batch, :, : max(lengths)] for t in store.layer(i))
                for kind, i in self.store_layers.items()
            }
        else:
            shared = {kind: layer_entries(first, i) for kind, i in self.store_layers.items()}  # [1, H, L, d]
        device = steps[0][1].device
        inputs = torch.zeros(batch, n, 2 * self.target.config.get_text_config().hidden_size, device=device,
                             dtype=self.dtype)  # fmt: skip
        position_ids = torch.zeros(batch, n, dtype=torch.long, device=device)
        for row, (_, tokens, states, position) in zip(rows, steps, strict=True):
            k = tokens.shape[0]
            inputs[row, :k] = torch.cat([self.target.embeddings(tokens), states.to(self.dtype)], dim=-1)
            position_ids[row] = position
        model = self.model
        with model_lock(
            model
        ):  # the model's forward, its masks those of one query per node (see query_masks)
            x = model.pre_projection(inputs)  # [B, n, d_a]
            masks = query_masks(model, x, shared, lengths)
            # logits_to_keep=None: every node's output is wanted (an int would have transformers cut the queries of
            # the layers that reuse keys, which fails on a model without per-layer inputs, an assistant's, for n > 1)
            out = model.model(
                inputs_embeds=x,
                attention_mask=masks,
                position_ids=position_ids,
                shared_kv_states=shared,
                logits_to_keep=None,
            )
            hidden = out.last_hidden_state  # [B, n, d_a]
            ordered = model.config.use_ordered_embeddings
            logits = (
                model.masked_embedding(hidden, model.lm_head.weight) if ordered else model.lm_head(hidden)
            )
            returned = model.post_projection(hidden)  # [B, n, D]
        return [
            (logits[row, : len(step[1])], returned[row, : len(step[1])])
            for row, step in zip(rows, steps, strict=True)
        ]

    @torch.inference_mode()
    def forward(
        self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`draft_step` of ``n`` nodes drafted from the root's state (what the cost probe times: a level of
        ``n`` nodes); ``[n, V]`` logits."""
        states = state.hidden.expand(tokens.shape[0], -1)
        return self.draft_step(state, tokens, states, int(positions[0]))[0]


def query_masks(
    model: torch.nn.Module, x: torch.Tensor, shared: dict[str, Any], lengths: list[int]
) -> dict[str, torch.Tensor]:
    """The assistant's attention masks for rows of ``n`` nodes, ``x`` ``[B, n, d]``, each node a query under the mask
    transformers builds for one query over its row's ``lengths[b]`` keys (``create_attention_masks``, what a forward
    of one candidate uses; the keys past a row's length hidden), as an additive ``[B, 1, n, L]`` mask per kind of
    layer (``L`` the keys ``shared`` holds).

    Why not the forward's own masks over the ``n`` queries: it reads them as a sequence (the local layers' window
    then shifts with the query's index), where the nodes of a level are independent; and why not ``n`` rows of one
    query each: every row would take its own copy of the target's keys (``[n, heads, L, d]``, gigabytes for a tree
    over a long prompt), where one row reads them once."""
    batch, n = x.shape[:2]
    masks = {  # [B, 1, 1, L]: nothing seen until a row's own keys are filled in
        kind: x.new_full((batch, 1, 1, keys.shape[2]), torch.finfo(x.dtype).min)
        for kind, (keys, _) in shared.items()
    }
    for row, length in enumerate(lengths):
        own = {kind: (keys[row : row + 1, :, :length], values[row : row + 1, :, :length])
               for kind, (keys, values) in shared.items()}  # fmt: skip
        for kind, one in model.create_attention_masks(x[row : row + 1, :1], None, own).items():
            if one is None:  # [1, 1, 1, length] or None (all its keys)
                one = x.new_zeros(1, 1, 1, length)
            elif one.dtype == torch.bool:
                one = torch.zeros_like(one, dtype=x.dtype).masked_fill(~one, torch.finfo(x.dtype).min)
            masks[kind][row, :, :, :length] = one[0]
    return {kind: mask.expand(-1, -1, n, -1) for kind, mask in masks.items()}


def check_assistant(model: torch.nn.Module, target: torch.nn.Module) -> None:
    """Refuse an assistant that cannot draft for ``target``: another family, another width, or attention that
    does not fit the keys of the target's layers it reads.

    Raises:
        InvalidInputError: naming what differs and what to use.
    """
    check_assistant_family(model.config.model_type, target.config.model_type)
    width = target.config.get_text_config().hidden_size
    if model.config.backbone_hidden_size != width:
        raise InvalidInputError(
            f"the assistant was made for a target of width {model.config.backbone_hidden_size}, but this target's is "
            f"{width}; give the assistant made for this target (e.g. google/gemma-4-31B-it-assistant for gemma-4-31B-it)"
        )
    text, own = target.config.get_text_config(), model.config.get_text_config()
    for kind, index in store_layers(text).items():
        theirs, ours = _head_width(text, index), _head_width(own, own.layer_types.index(kind))
        if theirs != ours:
            raise InvalidInputError(
                f"the assistant's {kind} layers have heads of {ours} but the target's keys there are {theirs} wide; "
                "give the assistant made for this target"
            )


def store_layers(text_config: Any) -> dict[str, int]:
    """The target layer whose keys an assistant's layers of each kind read: the last of that kind that keeps its
    own (``kv_sharing_modes`` ``"store"``), by layer type."""
    modes = text_config.kv_sharing_modes
    return {text_config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}


def check_assistant_family(draft_type: str, target_type: str) -> None:
    """Refuse an assistant of ``model_type`` ``draft_type`` for a target of another family (before any weights load).

    Raises:
        InvalidInputError: naming both and what to use.
    """
    family = ASSISTANT_TYPES[draft_type]
    if target_type != family:
        raise InvalidInputError(
            f"a {draft_type!r} draft drafts for {family!r} targets, not {target_type!r}; give the assistant made for "
            "the target, or a draft of the target's own family"
        )


def _key_shape(model: torch.nn.Module, index: int) -> tuple[int, int]:
    """(key heads, head width) of decoder layer ``index`` of a Gemma 4 model."""
    layer = layer_config(model.config.get_text_config(), index)
    return config_value(layer, "num_key_value_heads"), config_value(layer, "head_dim")


def _head_width(config: Any, index: int) -> int:
    return config_value(layer_config(config, index), "head_dim")
