"""What the adapters hand the engine: a model's decoding state, a prefill's output, where a prompt's visual tokens
sit, and a modality's visual features (see :mod:`vlmspec.models.base` for the adapter contract)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache

from ..cache import cache_length


@dataclass
class DecodeState:
    """Per-request decoding state of one model.

    Attributes:
        cache: the model's KV cache.
        rope_delta: ``[]`` long, offset added to logical positions to get rotary positions (0 without M-RoPE).
        visual_tokens: number of visual tokens the prefill held (after pruning, for a pruned draft).
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
        logits: ``[V]`` logits at the last prompt position (the last *kept* one for a pruned prefill).
        state: the new decoding state.
        visual_scores: ``[num_visual]`` float32 attention each visual token receives from the text after the last
            visual token (mean over heads, layers and those text queries), in the order of the visual positions
            (of the kept ones when ``keep`` was given); only when asked for.
        hidden: ``[L, D]`` output of the decoder layer ``hidden_layer`` at every prompt position (the soft prompt
            of an EDD draft); only when asked for.
        position_ids: the rotary position ids the prompt ran at (``[1, L]``, or ``[3, 1, L]`` with M-RoPE); only
            with ``hidden``.
        cached: prompt positions taken from a cache instead of being run (:meth:`VLMAdapter.extend`; 0 for a
            fresh prefill). ``hidden`` and ``position_ids`` then cover the positions from ``cached`` on.
    """

    logits: torch.Tensor
    state: DecodeState
    visual_scores: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cached: int = 0


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


@dataclass
class VisualFeatures:
    """Language-model-ready features of every placeholder token of one modality (all images, or all videos).

    Attributes:
        embeds: ``[n, D]`` features, in the order of the modality's placeholder tokens in the prompt.
        deepstack: Qwen3-VL only: per deepstack layer, ``[n, D]`` features added to that decoder layer's output.
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor] | None = None
