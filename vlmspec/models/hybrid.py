"""Families whose language models have recurrent layers beside their attention layers (Qwen3.5's Gated DeltaNet,
LFM2's short gated convolutions): what their adapters share.

A prompt is the model's own forward, exactly what ``generate()`` runs: transformers fills the recurrent layers'
states, which move with the keys into a store row (:mod:`vlmspec.recurrent_cache`). Every decoding forward (a
draft's level, a verified tree, a chain) runs the decoder here, layer by layer with the layers' own modules: the
attention layers as transformers runs them, under the tree mask over the cache; the recurrent layers over the tree,
each entry advancing its own ancestors' state (:mod:`.gated_delta`, :mod:`.short_conv`). Each family writes its
decoder layer out (:meth:`HybridDecoder.decoder_layer`: norm, mixer, residual, norm, MLP, residual), because
transformers' layer would run the tree's nodes as one sequence.

A recurrent state holds its whole prefix and cannot be cut back to a part of it: a prefix cache or a conversation
reuses a held cache where it ends, or where its prompt ended (the states are kept there as a checkpoint,
:func:`vlmspec.cache.checkpoint`), else the prompt is prefilled afresh. EDD drafts are refused
(:mod:`vlmspec.models.edd` says why).
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch

from ..cache import BatchCache, RowCache, attention_prefix, copy_cache, decodable, has_recurrent_layers
from ..recurrent_cache import RecurrentRows, TreeLinks
from ..tree import tree_attention_bias
from .attention import model_lock, text_after_visual, visual_attention_probe
from .base import DecodeState, Prefill, VLMAdapter


class LayerCall(NamedTuple):
    """What a decoder layer of a decoding forward reads besides its input (:meth:`HybridDecoder.decoder_layer`)."""

    index: int
    """The layer's index in the model."""
    attend: dict[str, Any]
    """An attention layer's keyword arguments (rotary embeddings, mask, cache); ``{}`` for a recurrent one where the
    attention layers differ (:meth:`HybridDecoder.layer_attention`)."""
    recurrent: RecurrentRows | None
    """The model's recurrent rows (``None``: a cache without them, a model of attention layers only)."""
    links: TreeLinks | None
    """The forward's :func:`~vlmspec.recurrent_cache.tree_links`."""


class HybridDecoder(VLMAdapter):
    """A hybrid family's adapter; subclasses write their decoder layer (:meth:`decoder_layer`) and name their
    attention layers' input norm and their last norm (:attr:`attention_norm_name`, :attr:`final_norm_name`); a
    family whose attention layers differ (local and global ones) gives each its own inputs
    (:meth:`attention_inputs`, :meth:`layer_attention`)."""

    attention_norm_name: ClassVar[str] = ""
    """The decoder layer's norm whose output is an attention layer's input."""
    final_norm_name: ClassVar[str] = ""
    """The language model's norm after the last layer."""

    @property
    def text_model(self) -> torch.nn.Module:
        """The language model (its ``layers``, ``rotary_emb`` and norms)."""
        return self.model.model.language_model

    def attending(self) -> list[int]:
        """The indices of the attention layers."""
        return [i for i, layer in enumerate(self.text_model.layers) if hasattr(layer, "self_attn")]

    def attention_inputs(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor, cache: Any
    ) -> dict[str, Any]:
        """The attention layers' keyword arguments for a forward of ``hidden`` ``[B, n, D]`` at ``position_ids``
        under the tree mask ``bias``: their rotary embeddings, mask and cache."""
        rotary = self.text_model.rotary_emb(hidden, position_ids)
        return {"position_embeddings": rotary, "attention_mask": bias, "cache": cache}

    def layer_attention(self, attend: dict[str, Any], layer: torch.nn.Module) -> dict[str, Any]:
        """Decoder layer ``layer``'s among :meth:`attention_inputs`' (all of them: the attention layers are alike)."""
        return attend

    def decoder_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """Decoder layer ``layer``'s output ``[B, n, D]`` for ``hidden`` ``[B, n, D]``: an attention layer called
        with ``call.attend``, a recurrent one over ``call.links``."""
        raise NotImplementedError

    def _hook_layer_output(self, layer: int, found: list[torch.Tensor]) -> Any:
        """Layer ``layer``'s output read as the input of what runs next (the next layer's first norm, or the last
        norm): the written-out decoder calls no decoder layer as a module, but it calls their norms, as
        transformers' own forward does (an EDD draft reads a hybrid target's hidden states so)."""
        text = self.text_model
        after = text.layers[layer + 1] if layer + 1 < len(text.layers) else None
        norm = (
            getattr(after, self.attention_norm_name)
            if after is not None
            else getattr(text, self.final_norm_name)
        )
        return norm.register_forward_pre_hook(lambda _module, args: found.append(args[0]))

    def prefill(self, inputs: dict[str, torch.Tensor], keep: Any = None, **options: Any) -> Prefill:
        """:meth:`VLMAdapter.prefill` (same arguments); the visual scores come from the attention layers alone (see
        :meth:`_scored_prefill`)."""
        if options.get("score_visual") and keep is None and options.get("hidden_layer") is None:
            return self._scored_prefill(inputs)
        return super().prefill(inputs, keep=keep, **options)

    @torch.inference_mode()
    def _scored_prefill(self, inputs: dict[str, torch.Tensor]) -> Prefill:
        """The model's own prefill, and the attention the text after the last visual token pays to each visual token.

        The other families' side pass runs that text again on the cache cut back to the visual prefix; recurrent
        states cannot be cut back. It needs no more than this, though: each attention layer's input at those
        positions (kept by a hook during the prefill, as the side pass would recompute it) and the layer's keys
        before them. Each attention layer runs once more on its kept input, under eager attention, over its own
        keys of the visual prefix; the scores are the mean over heads, layers and queries, as the side pass's.
        """
        layout = self.prompt_layout(inputs)
        visual_idx, split = text_after_visual(layout, self.device)
        if split is None:  # no text after the last visual token: nothing to score
            return super().prefill(inputs)
        text, attending = self.text_model, self.attending()
        kept: dict[int, torch.Tensor] = {}
        with model_lock(self.model):
            handles = [
                getattr(text.layers[i], self.attention_norm_name).register_forward_hook(
                    lambda _m, _a, out, i=i: kept.__setitem__(i, out[:, split:])
                )
                for i in attending
            ]
            try:
                prefill = super().prefill(inputs)
            finally:
                for handle in handles:
                    handle.remove()
            rope, _ = self.prompt_rope(inputs)
            tail = kept[attending[0]]
            rope = (
                torch.arange(inputs["input_ids"].shape[1], device=self.device)[None] if rope is None else rope
            )
            causal = torch.ones(tail.shape[1], tail.shape[1], dtype=torch.bool, device=self.device).tril()
            bias = tree_attention_bias(causal, split, self.dtype)  # [1, 1, m, split + m]
            attend = self.attention_inputs(tail, rope[..., split:], bias, None)
            with visual_attention_probe(self.model, visual_idx) as probe:
                for i in attending:
                    prefix = attention_prefix(prefill.state.cache, i, split)
                    kwargs = self.layer_attention(attend, text.layers[i]) | {"cache": prefix}
                    text.layers[i].self_attn(hidden_states=kept[i], **kwargs)
        prefill.visual_scores = probe.scores()
        return prefill

    def prefill_many(
        self, prompts: list[dict[str, torch.Tensor]], keeps: Any = None, **options: Any
    ) -> list[Prefill]:
        """:meth:`VLMAdapter.prefill_many` (same arguments), one prompt after the other: in a right-padded batch the
        padding would run through the shorter prompts' recurrent states."""
        scores = options.get("score_visual", False)
        scores = scores if isinstance(scores, list) else [scores] * len(prompts)
        keeps = keeps or [None] * len(prompts)
        return [
            self.prefill(p, keep=k, score_visual=s) for p, k, s in zip(prompts, keeps, scores, strict=True)
        ]

    def extend(self, state: DecodeState, *args: Any, **kwargs: Any) -> Prefill:
        """:meth:`VLMAdapter.extend`: the prompt runs on through transformers' own forward, on the held cache as a
        prefill leaves it (a store row's copied out, or one restored to a checkpoint by the prefix cache)."""
        state.cache = copy_cache(state.cache) if isinstance(state.cache, RowCache) else state.cache
        return super().extend(state, *args, **kwargs)

    @torch.inference_mode()
    def forward(
        self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`VLMAdapter.forward`; on a fresh cache (the cost probe's prefix) the tokens run as a prompt."""
        if state.length == 0:
            rope = self.rope_ids(positions, state.rope_delta)
            hidden = self._run_language_model({"inputs_embeds": self.embed(tokens)[None]}, rope, state.cache)
            state.cache = decodable(state.cache)
            return self.model.get_output_embeddings()(hidden)[0]
        state.cache = decodable(state.cache)
        return super().forward(state, tokens, positions, bias)

    @torch.inference_mode()
    def forward_root(self, state: DecodeState, *args: Any) -> torch.Tensor:
        state.cache = decodable(state.cache)  # a prefill's cache moves into a store row of its own first
        return super().forward_root(state, *args)

    @torch.inference_mode()
    def forward_hidden(self, state: DecodeState, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        state.cache = decodable(state.cache)  # as forward_root
        return super().forward_hidden(state, *args)

    def _logits(
        self, cache: Any, rows: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """The decoder written out (see the module's docstring): ``[B, n, V]`` logits of ``rows`` over ``cache`` (a
        store row, or the store's rows together)."""
        recurrent = cache.store.recurrent if isinstance(cache, RowCache | BatchCache) else None
        if recurrent is None and has_recurrent_layers(cache):
            raise RuntimeError(
                f"{type(self).__name__} decodes on a KVStore row: move a prefill's cache there (cache.decodable)"
            )
        links = cache.tree_links(bias) if recurrent is not None else None  # before any layer writes
        hidden = rows
        attend = self.attention_inputs(hidden, position_ids, bias, cache)
        for index, layer in enumerate(self.text_model.layers):
            call = LayerCall(index, self.layer_attention(attend, layer), recurrent, links)
            hidden = self.decoder_layer(layer, hidden, call)
        final_norm = getattr(self.text_model, self.final_norm_name)
        return self.model.get_output_embeddings()(final_norm(hidden))
