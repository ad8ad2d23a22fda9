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

    @torch.inference_mode()
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
        n = tokens.shape[0]
        rows = torch.cat([self.target.embeddings(tokens), states.to(self.dtype)], dim=-1)[None]  # [1, n, 2D]
        shared = {
            kind: layer_entries(state.target.cache, i) for kind, i in self.store_layers.items()
        }  # [1, H, L, d]
        position_ids = torch.full((1, n), position, dtype=torch.long, device=tokens.device)
        model = self.model
        with model_lock(
            model
        ):  # the model's forward, its masks those of one query per node (see query_masks)
            x = model.pre_projection(rows)  # [1, n, d_a]
            masks = query_masks(model, x, shared)
            # logits_to_keep=None: every node's output is wanted (an int would have transformers cut the queries of
            # the layers that reuse keys, which fails on a model without per-layer inputs, an assistant's, for n > 1)
            out = model.model(
                inputs_embeds=x,
                attention_mask=masks,
                position_ids=position_ids,
                shared_kv_states=shared,
                logits_to_keep=None,
            )
            hidden = out.last_hidden_state  # [1, n, d_a]
            ordered = model.config.use_ordered_embeddings
            logits = (
                model.masked_embedding(hidden, model.lm_head.weight) if ordered else model.lm_head(hidden)
            )
            return logits[0], model.post_projection(hidden)[0]

    @torch.inference_mode()
    def forward(
        self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`draft_step` of ``n`` nodes drafted from the root's state (what the cost probe times: a level of
        ``n`` nodes); ``[n, V]`` logits."""
        states = state.hidden.expand(tokens.shape[0], -1)
        return self.draft_step(state, tokens, states, int(positions[0]))[0]


def query_masks(model: torch.nn.Module, x: torch.Tensor, shared: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The assistant's attention masks for ``n`` nodes as ``n`` queries of one row ``x`` ``[1, n, d]``, each the
    mask transformers builds for one query (``create_attention_masks``, what a forward of one candidate uses), as an
    additive ``[1, 1, n, L]`` mask per kind of layer.

    Why not the forward's own masks over the ``n`` queries: it reads them as a sequence (the local layers' window
    then shifts with the query's index), where the nodes of a level are independent; and why not ``n`` rows of one
    query each: every row would take its own copy of the target's keys (``[n, heads, L, d]``, gigabytes for a tree
    over a long prompt), where one row reads them once."""
    one = model.create_attention_masks(x[:, :1], None, shared)  # {kind: [1, 1, 1, L] or None (all keys)}
    masks = {}
    for kind, mask in one.items():
        keys = shared[kind][0].shape[2]
        if mask is None:
            mask = x.new_zeros(1, 1, 1, keys)
        elif mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=x.dtype).masked_fill(~mask, torch.finfo(x.dtype).min)
        masks[kind] = mask.expand(-1, -1, x.shape[1], -1)
    return masks


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
