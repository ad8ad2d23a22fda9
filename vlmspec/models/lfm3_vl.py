"""LFM3-VL (``LiquidAI/LFM3-VL-2B``): Qwen2-VL's flat patches (``pixel_values`` ``[patches, D]`` with
``image_grid_thw``, two frames deep; Qwen3-VL's video processor, each frame after its time) read by LFM3-VL's own
tower, the tokens merged 2 x 2 and projected, in front of LFM3: short gated convolutions (recurrent layers, 7 wide:
:mod:`.hybrid`, :mod:`.short_conv`), local (sliding-window) and global attention layers, each kind with its own
rotary table (the global layers' on part of the head), every block's output normed before the residual (sandwich
norms), and 1-D positions.

Pictures and videos are cut by prompt and by item as Qwen's (:class:`~vlmspec.models.qwen.QwenVLAdapter`); the
decoder is LFM2's layer (:class:`~vlmspec.models.lfm2_vl.LfmDecoder`) with its sandwich norms; the local layers
see the tree through Gemma 3's window masks (:func:`~vlmspec.models.gemma3.window_masks`: the tree mask with the keys
outside each query's window hidden; a cache entry's index is its position, as in Gemma 3's).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import VLMAdapter
from .gemma3 import window_masks
from .lfm2_vl import LfmDecoder
from .qwen import QwenVLAdapter


class Lfm3VlAdapter(LfmDecoder, QwenVLAdapter):
    model_types = ("lfm3_vl",)

    @property
    def min_video_frames(self) -> int:
        return 2  # Qwen3-VL's video processor refuses a video shorter than its temporal patch

    def prompt_rope(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """1-D positions (the model's default): LFM3's rotary tables read one index per token."""
        return VLMAdapter.prompt_rope(self, inputs)

    @staticmethod
    def rope_ids(positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        return positions[None]  # [1, n]

    def attention_inputs(
        self, hidden: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor, cache: Any
    ) -> dict[str, Any]:
        """Per attention kind (``full_attention``, ``sliding_attention``): its rotary embeddings, its mask (the local
        kind's hides the keys outside each query's window) and the cache."""
        text = self.text_model
        masks = window_masks(bias, position_ids, text.config.sliding_window)
        return {
            kind: {
                "position_embeddings": text.rotary_emb(hidden, position_ids, layer_type=kind),
                "attention_mask": masks[kind],
                "cache": cache,
            }
            for kind in text.rotary_emb.layer_types
        }

    def layer_attention(self, attend: dict[str, Any], layer: torch.nn.Module) -> dict[str, Any]:
        return attend[layer.self_attn.layer_type] if layer.is_attention_layer else {}
