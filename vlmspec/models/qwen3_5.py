"""Qwen3.5 (dense and mixture-of-experts): Qwen3-VL's vision tower, processor and M-RoPE, with a hybrid language
model of Gated DeltaNet (recurrent) layers and attention layers (three to one in the released models).

How a tree goes through the recurrent layers, and what cannot be cut back: :mod:`.hybrid`; the Gated DeltaNet step
over a tree: :mod:`.gated_delta`.
"""

from __future__ import annotations

import torch

from .gated_delta import gated_delta_tree
from .hybrid import HybridDecoder, LayerCall
from .qwen import QwenVLAdapter


class GatedDeltaDecoder(HybridDecoder):
    """Qwen3.5's language model (its own VLMs' and MiniCPM-V 4.6's): the adapters' shared part."""

    attention_norm_name, final_norm_name = "input_layernorm", "norm"

    def decoder_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """Qwen3.5's decoder layer: norm, mixer, residual, norm, MLP (dense, or routed experts), residual."""
        mixed = layer.input_layernorm(hidden)
        if layer.block_type == "linear_attention":
            mixed = gated_delta_tree(layer.linear_attn, mixed, call)
        else:
            mixed = layer.self_attn(hidden_states=mixed, **call.attend)[0]
        hidden = hidden + mixed
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


class Qwen3_5Adapter(GatedDeltaDecoder, QwenVLAdapter):
    model_types = ("qwen3_5", "qwen3_5_moe")

    @property
    def min_video_frames(self) -> int:
        return 2  # Qwen3-VL's video processor refuses a video shorter than its temporal patch
