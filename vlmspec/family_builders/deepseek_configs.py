"""The configs of DeepSeek's families with a SigLIP tower and an aligner in front of a Llama language model: Janus
(Janus-Pro), DeepSeek-VL and DeepSeek-VL's hybrid tower (SigLIP beside a SAM encoder reading the picture at a higher
resolution)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .chat import JANUS_NAMED_TOKENS
from .specs import ModelSpec, VisionLayout

DEEPSEEK_FAMILIES: tuple[str, ...] = ("janus", "deepseek_vl", "deepseek_vl_hybrid")
HIGH_RES_SIDE = 28
"""DeepSeek-VL hybrid's fixtures: the SAM encoder's input side (the real models': 1024 pixels)."""


def deepseek_config_kwargs(
    family: str,
    spec: ModelSpec,
    text: dict[str, Any],
    tid: Callable[[str], int],
    layout: VisionLayout,
    tower: dict[str, Any],
) -> dict[str, Any]:
    """``JanusConfig``'s, ``DeepseekVLConfig``'s or ``DeepseekVLHybridConfig``'s arguments: ``text`` (a Llama
    language model, DeepSeek-LLM's) behind the SigLIP ``tower`` whose patch features go through an aligner, one
    token per patch; Janus's image-generation parts (a VQ model, its embeddings and head, which reading pictures
    never runs) at their smallest; the hybrid's SAM encoder at :data:`HIGH_RES_SIDE` pixels, its features
    resampled to the SigLIP grid by the model."""
    common = {
        "text_config": text,
        "image_token_id": tid(JANUS_NAMED_TOKENS["image_token"]),
        "tie_word_embeddings": False,
    }
    siglip = {**tower, "model_type": "siglip_vision_model"}
    if family == "deepseek_vl":
        return common | {"vision_config": siglip}
    if family == "deepseek_vl_hybrid":
        sam = {
            "model_type": "sam_vision_model",
            "hidden_size": spec.vision_hidden,
            "output_channels": spec.vision_hidden // 2,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "mlp_dim": 2 * spec.vision_hidden,
            "image_size": HIGH_RES_SIDE,
            "patch_size": layout.patch // 2,  # twice SigLIP's patches a side
            "window_size": 2,
            "global_attn_indexes": [spec.vision_layers - 1],
        }
        return common | {"vision_config": siglip, "high_res_vision_config": sam}
    hidden = spec.hidden
    janus_tower = tower | {
        "projection_dim": hidden,
        "num_image_tokens": (layout.crop_side // layout.patch) ** 2,
    }
    return common | {
        "vision_config": janus_tower,
        "vq_config": {
            "embed_dim": 4,
            "num_embeddings": 16,
            "latent_channels": 32,  # its group norms take 32 groups
            "base_channels": 32,
            "channel_multiplier": [1, 1],
            "num_res_blocks": 1,
            "num_patches": 2,
            "projection_dim": hidden,
            "image_token_embed_dim": hidden,
        },
    }
