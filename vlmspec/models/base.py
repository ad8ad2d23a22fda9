"""The adapter contract: what the engine needs from a VLM family, and nothing else.

An adapter wraps one loaded ``*ForConditionalGeneration`` model and offers three things:

* ``prefill(inputs, keep=None)``: run the multimodal prompt (optionally only the prompt positions in ``keep``,
  for the pruned draft) and return the last position's logits with a fresh :class:`DecodeState`;
* ``forward(state, tokens, positions, bias)``: run ``n`` new tokens at explicit *logical* positions under an
  explicit additive mask on top of the cache and return their logits;
* ``prompt_layout(inputs)``: which prompt positions are visual tokens.

*Logical* positions count tokens of the full (unpruned) sequence: the prompt occupies ``0 .. L-1`` and the
``i``-th generated token sits at ``L + i``. Each family maps them to its own rotary positions (M-RoPE for the
Qwen families adds the prompt's ``rope_delta``), so a pruned draft keeps every kept token at its original place
while its cache is shorter than the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers.cache_utils import DynamicCache

from ..cache import cache_length, new_cache


@dataclass
class DecodeState:
    """Per-request decoding state of one model.

    Attributes:
        cache: the model's KV cache.
        rope_delta: ``[]`` long, offset added to logical positions to get rotary positions (0 without M-RoPE).
        visual_tokens: number of visual tokens the prefill held.
    """

    cache: DynamicCache
    rope_delta: torch.Tensor
    visual_tokens: int

    @property
    def length(self) -> int:
        """Tokens currently held by the cache."""
        return cache_length(self.cache)


@dataclass
class Prefill:
    """Output of a prefill.

    Attributes:
        logits: ``[V]`` logits at the last prompt position.
        state: the new decoding state.
        visual_scores: ``[num_visual]`` attention each visual token receives from the text after the last visual
            token (mean over heads, layers and those text queries); only when asked for.
    """

    logits: torch.Tensor
    state: DecodeState
    visual_scores: torch.Tensor | None = None


@dataclass
class PromptLayout:
    """Where the visual tokens sit in a tokenised prompt.

    Attributes:
        visual: ``[L]`` bool, true at visual placeholder positions (image or video tokens).
        is_video: ``[L]`` bool, true at video placeholder positions.
    """

    visual: torch.Tensor
    is_video: torch.Tensor

    @property
    def num_visual(self) -> int:
        return int(self.visual.sum())


class VLMAdapter:
    """Base adapter; subclasses set ``model_types`` and override the position/embedding hooks."""

    model_types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_positions(self) -> int | None:
        """The language model's context length, if the config states it."""
        return getattr(self.config.get_text_config(), "max_position_embeddings", None)

    # ---- family hooks -------------------------------------------------------------------------------------
    def visual_token_ids(self) -> tuple[int, int]:
        """(image placeholder id, video placeholder id)."""
        raise NotImplementedError

    def prompt_rope(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rotary position ids of the prompt (``None``: the model's default) and the decode ``rope_delta``."""
        return None, torch.zeros((), dtype=torch.long, device=self.device)

    def rope_ids(self, positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        """Model ``position_ids`` for ``[n]`` logical positions of generated (text) tokens."""
        return positions[None]  # [1, n]

    def embed_prompt(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Language-model inputs for the whole prompt with visual features merged in (used for pruning)."""
        raise NotImplementedError(f"{type(self).__name__} does not support draft visual-token pruning yet")

    # ---- shared ---------------------------------------------------------------------------------------------
    def prompt_layout(self, inputs: dict[str, torch.Tensor]) -> PromptLayout:
        image_id, video_id = self.visual_token_ids()
        ids = inputs["input_ids"][0]
        is_video = ids == video_id
        return PromptLayout(visual=(ids == image_id) | is_video, is_video=is_video)

    @torch.no_grad()
    def prefill(
        self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None = None, score_visual: bool = False
    ) -> Prefill:
        """Run the multimodal prompt.

        Args:
            inputs: processor outputs for one prompt (batch 1), already on the model's device.
            keep: ``[K]`` ascending prompt positions to keep (all text positions plus the kept visual ones);
                ``None`` keeps everything. Kept tokens keep their original (rotary) positions.
            score_visual: also return ``visual_scores`` (attention-guided pruning of the draft).

        Returns:
            The last position's logits, the decoding state and (if asked) the visual scores.
        """
        if keep is not None or score_visual:
            raise NotImplementedError(f"{type(self).__name__}: pruned/scored prefill is not implemented")
        cache = new_cache(self.model)
        position_ids, rope_delta = self.prompt_rope(inputs)
        out = self.model(
            **inputs, position_ids=position_ids, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        state = DecodeState(cache=cache, rope_delta=rope_delta, visual_tokens=self.prompt_layout(inputs).num_visual)
        return Prefill(logits=out.logits[0, -1], state=state)

    @torch.no_grad()
    def forward(
        self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Feed ``n`` new tokens on top of the cache.

        Args:
            state: decoding state; its cache grows by ``n`` entries.
            tokens: ``[n]`` token ids.
            positions: ``[n]`` logical positions.
            bias: ``[1, 1, n, cache_len + n]`` additive attention mask.

        Returns:
            ``[n, V]`` logits.
        """
        out = self.model(
            input_ids=tokens[None],
            position_ids=self.rope_ids(positions, state.rope_delta),
            attention_mask=bias,
            past_key_values=state.cache,
            use_cache=True,
        )
        return out.logits[0]
