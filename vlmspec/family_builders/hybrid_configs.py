"""The config arguments of the families whose language models have recurrent layers (:data:`HYBRID_FAMILIES`):
Qwen3.5's Gated DeltaNet layers (Qwen3.5's own VLMs', MiniCPM-V 4.6's and 4.7's), LFM2's and LFM3's short gated
convolutions (LFM2-VL's, LFM3-VL's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .chat import LFM2_VL_NAMED_TOKENS, MINICPMV_NAMED_TOKENS
from .specs import FULL_ATTENTION_INTERVAL, ModelSpec, VisionLayout

LFM2_VL_TOKENS = (4, 16)
"""``(min, max)`` visual tokens of an LFM2-VL fixture picture read whole (the real models': 64 and 256); a larger one
is cut into tiles of ``crop_side`` pixels plus a thumbnail of at most the maximum."""

Kwargs = dict[str, Any]
TokenId = Callable[[str], int]
"""A tokenizer's token-to-id lookup."""
_LFM2_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}  # LFM2's own theta


def recurrent_text(family: str, spec: ModelSpec) -> dict[str, Any]:
    """The text config's layer types and recurrent layers' shapes: every :data:`FULL_ATTENTION_INTERVAL`-th layer
    attends, and the last (so a model of one layer has one); the others are Qwen3.5's Gated DeltaNet layers (value
    heads twice the key heads, as the real models', a 4-wide convolution) or LFM2's short convolutions (3 wide, as
    the real models'); LFM3's convolutions are 7 wide (as the real models'), its attention layers local but the
    last."""
    attends = [(i + 1) % FULL_ATTENTION_INTERVAL == 0 or i == spec.layers - 1 for i in range(spec.layers)]
    if family == "lfm3_vl":
        last = (
            spec.layers - 1
        )  # the attention layers local (a window of spec.sliding_window tokens) but the last
        types = [
            "conv" if not full else "full_attention" if i == last else "sliding_attention"
            for i, full in enumerate(attends)
        ]
        return {"layer_types": types, "conv_L_cache": 7, "sliding_window": spec.sliding_window}
    if family == "lfm2_vl":
        return {
            "layer_types": ["full_attention" if full else "conv" for full in attends],
            "conv_L_cache": 3,
            "block_auto_adjust_ff_dim": False,  # the MLP as wide as ``spec`` says
        }
    heads = spec.hidden // spec.head_dim
    return {
        "layer_types": ["full_attention" if full else "linear_attention" for full in attends],
        "linear_num_key_heads": heads // 2,
        "linear_num_value_heads": heads,
        "linear_key_head_dim": spec.head_dim,
        "linear_value_head_dim": spec.head_dim,
        "linear_conv_kernel_dim": 4,
    }


def liquid_config_kwargs(
    family: str, text: Kwargs, tid: TokenId, layout: VisionLayout, vision: Kwargs
) -> Kwargs:
    """``Lfm2VlConfig``'s or ``Lfm3VlConfig``'s arguments: the language model behind the tower (``vision``: its
    widths), whose tokens, 2 x 2 patches each, are projected (the projector twice the language model's width), as
    every size's.

    LFM2-VL: LFM2 behind a SigLIP2 NaFlex tower (patches of ``patch`` pixels at any aspect ratio, its position table
    of the most patches a picture or tile has). LFM3-VL: LFM3 (its own rotary tables per attention type: the local
    layers' whole, the global ones' on half the head) behind LFM3-VL's tower (a convolution layer, then an attention
    layer, over Qwen2-VL's flat patches of ``patch`` pixels, two frames deep)."""
    shared = {"projector_hidden_size": 2 * text["hidden_size"], "tie_word_embeddings": False}
    if family == "lfm2_vl":
        most_patches = max(LFM2_VL_TOKENS[1] * 4, (layout.crop_side // layout.patch) ** 2)
        return shared | {
            "text_config": {**text, "model_type": "lfm2", "rope_parameters": _LFM2_ROPE},
            "vision_config": {
                **vision,
                "model_type": "siglip2_vision_model",
                "patch_size": layout.patch,
                "num_patches": most_patches,
                "vision_use_head": False,
            },
            "downsample_factor": 2,
            "image_token_id": tid(LFM2_VL_NAMED_TOKENS["image_token"]),
        }
    return shared | {
        "text_config": {**text, "model_type": "lfm3"},
        "vision_config": {
            **vision,
            "num_key_value_heads": vision["num_attention_heads"],
            "patch_size": layout.patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "layer_types": ["conv", "full_attention"][: vision["num_hidden_layers"]],
        },
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
        "vision_end_token_id": tid("<|vision_end|>"),
    }


def minicpmv_config_kwargs(
    family: str, text: Kwargs, tid: TokenId, layout: VisionLayout, vision: Kwargs
) -> Kwargs:
    """``MiniCPMV4_6Config``'s or ``MiniCPMV4_7Config``'s arguments: Qwen3.5's language model (``text``, with its
    M-RoPE settings, which 1-D positions turn into plain RoPE) behind their NaViT tower (``vision``: its widths;
    patches of ``patch`` pixels, position buckets for ``crop_side``-pixel pictures, its window-attention merger after
    the first layer), tokens merged 2 x 2 twice (``16x``). MiniCPM-V 4.7's also names the tags its Canvas M-RoPE pins to the
    corners of each item (and the newline between rows of slices)."""
    canvas = {}
    if family == "minicpmv4_7":
        named = MINICPMV_NAMED_TOKENS
        canvas = {
            "image_start_id": tid(named["image_start_token"]),
            "image_end_id": tid(named["image_end_token"]),
            "slice_start_id": tid(named["slice_start_token"]),
            "slice_end_id": tid(named["slice_end_token"]),
            "newline_id": tid("\u010a"),  # "\n", as the byte-level vocabulary writes it
        }
    return canvas | {
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {**vision, "patch_size": layout.patch, "image_size": layout.crop_side},
        "insert_layer_id": 0,
        "image_size": layout.crop_side,
        "image_token_id": tid(MINICPMV_NAMED_TOKENS["image_token"]),
        "video_token_id": tid(MINICPMV_NAMED_TOKENS["video_token"]),
        "tie_word_embeddings": False,
    }
