"""Qwen3.5 (dense and mixture-of-experts): Qwen3-VL's vision tower, processor and M-RoPE, with a hybrid language
model of Gated DeltaNet (recurrent) layers and attention layers (three to one in the released models).

How a tree goes through the recurrent layers, and what cannot be cut back: :mod:`.hybrid`; the Gated DeltaNet step
over a tree: :mod:`.gated_delta`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..recurrent_cache import RecurrentRows, TreeLinks
from .gated_delta import gated_delta_tree
from .hybrid import HybridDecoder
from .qwen import QwenVLAdapter


class Qwen3_5Adapter(HybridDecoder, QwenVLAdapter):
    model_types = ("qwen3_5", "qwen3_5_moe")

    @property
    def min_video_frames(self) -> int:
        return 2  # Qwen3-VL's video processor refuses a video shorter than its temporal patch

    def attention_norm(self, layer: torch.nn.Module) -> torch.nn.Module:
        return layer.input_layernorm

    def final_norm(self) -> torch.nn.Module:
        return self.text_model.norm

    def decoder_layer(
        self,
        layer: torch.nn.Module,
        index: int,
        hidden: torch.Tensor,
        attend: dict[str, Any],
        recurrent: RecurrentRows | None,
        links: TreeLinks | None,
    ) -> torch.Tensor:
        """Qwen3.5's decoder layer: norm, mixer, residual, norm, MLP (dense, or routed experts), residual."""
        mixed = layer.input_layernorm(hidden)
        if layer.block_type == "linear_attention":
            mixed = gated_delta_tree(layer.linear_attn, mixed, recurrent, links, index)
        else:
            mixed = layer.self_attn(hidden_states=mixed, **attend)[0]
        hidden = hidden + mixed
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))
