"""Qwen3.5 (dense and mixture-of-experts): Qwen3-VL's vision tower, processor and M-RoPE, with a hybrid language
model of Gated DeltaNet (recurrent) layers and attention layers (three to one in the released models).

A prompt is the model's own forward, exactly what ``generate()`` runs: transformers' chunked scan fills the
recurrent layers' states, which move with the keys into a store row (:mod:`vlmspec.recurrent_cache`). Every
decoding forward (a draft's level, a verified tree, a chain) runs the decoder here, layer by layer with the layers'
own modules: the attention layers as transformers runs them, under the tree mask over the cache; the recurrent
layers through :func:`~vlmspec.models.gated_delta.gated_delta_tree`, each entry advancing its parent's state. The
two are the model's decoder layer written out (norm, mixer, residual, norm, MLP, residual), because transformers'
layer would run the tree's nodes as one sequence.

Not yet here, refused by name: attention-guided pruning of the draft (its side pass cuts the target's cache back
to the visual prefix, which a recurrent state cannot undo; the draft's pruning by position still works), EDD
drafts (they read the target's layers while it decodes), and reusing an earlier request's cache (a prefix cache,
a conversation's turns: a recurrent state holds the whole prefix, not a part of it).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import decodable
from ..errors import InvalidInputError
from .base import DecodeState, Prefill
from .gated_delta import gated_delta_tree
from .qwen import QwenVLAdapter

_REFUSED = (
    "{what} is not supported with Qwen3.5's recurrent layers yet ({why}); {instead}"
)


class Qwen3_5Adapter(QwenVLAdapter):
    model_types = ("qwen3_5", "qwen3_5_moe")

    @property
    def min_video_frames(self) -> int:
        return 2  # Qwen3-VL's video processor refuses a video shorter than its temporal patch

    def prefill(self, inputs: dict[str, torch.Tensor], keep: Any = None, score_visual: bool = False, **kw: Any) -> Prefill:
        if score_visual:
            raise InvalidInputError(
                _REFUSED.format(
                    what="attention-guided draft pruning",
                    why="its scores come from a side pass on the target's cache cut back to the visual prefix",
                    instead="prune the draft by position (PruningConfig(method='uniform')) or not at all",
                )
            )
        if kw.get("hidden_layer") is not None:
            raise InvalidInputError(
                _REFUSED.format(
                    what="an EDD draft", why="it reads the target's layers as it decodes", instead="use a Qwen3.5 draft"
                )
            )
        return super().prefill(inputs, keep=keep, **kw)

    def prefill_many(
        self,
        prompts: list[dict[str, torch.Tensor]],
        keeps: list[torch.Tensor | None] | None = None,
        score_visual: bool | list[bool] = False,
    ) -> list[Prefill]:
        """One prefill after the other: in a right-padded batch the padding would run through the shorter prompts'
        recurrent states (their decay acts on any input)."""
        keeps = keeps or [None] * len(prompts)
        scores = score_visual if isinstance(score_visual, list) else [score_visual] * len(prompts)
        return [self.prefill(p, keep=k, score_visual=s) for p, k, s in zip(prompts, keeps, scores, strict=True)]

    def extend(self, *args: Any, **kwargs: Any) -> Prefill:
        raise InvalidInputError(
            _REFUSED.format(
                what="reusing an earlier request's cache (a prefix cache, a conversation's turns)",
                why="a recurrent state holds its whole prefix and cannot be cut back to a part of it",
                instead="run without a prefix cache: each request prefills its own prompt",
            )
        )

    @torch.inference_mode()
    def forward(
        self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`VLMAdapter.forward`; on a fresh cache (the cost probe's prefix) the tokens run as a prompt, and a
        prefill's cache moves into a store row of its own first (where tree forwards run)."""
        if state.length == 0:
            rope = self.rope_ids(positions, state.rope_delta)
            hidden = self._run_language_model({"inputs_embeds": self.embed(tokens)[None]}, rope, state.cache)
            state.cache = decodable(state.cache)
            return self.model.get_output_embeddings()(hidden)[0]
        state.cache = decodable(state.cache)
        return super().forward(state, tokens, positions, bias)

    def _logits(
        self, cache: Any, rows: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """The decoder written out (see the module's docstring): ``[B, n, V]`` logits of ``rows`` over ``cache`` (a
        store row, or the store's rows together)."""
        if not hasattr(cache, "tree_links"):
            raise RuntimeError("Qwen3.5 decodes on a KVStore row: move a prefill's cache there (cache.decodable)")
        links = cache.tree_links(bias)  # before any layer writes: the entries' ancestors, from the mask
        text = self.model.model.language_model
        hidden = rows
        rotary = text.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(text.layers):
            mixed = layer.input_layernorm(hidden)
            if layer.block_type == "linear_attention":
                mixed = gated_delta_tree(layer.linear_attn, mixed, cache.store.recurrent, links, index)
            else:
                mixed = layer.self_attn(
                    hidden_states=mixed, position_embeddings=rotary, attention_mask=bias, cache=cache
                )[0]
            hidden = hidden + mixed
            hidden = hidden + _mlp(layer.mlp, layer.post_attention_layernorm(hidden))
        return self.model.get_output_embeddings()(text.norm(hidden))


def _mlp(mlp: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A layer's MLP (dense, or Qwen3.5-MoE's routed experts, which also return their router's logits)."""
    out = mlp(hidden)
    return out[0] if isinstance(out, tuple) else out
