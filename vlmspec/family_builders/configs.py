"""The families' real config classes for a :class:`ModelSpec` and a :class:`VisionLayout`, and the fixtures'
generation config."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import GenerationConfig
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from .chat import (
    GEMMA3_NAMED_TOKENS,
    GEMMA4_NAMED_TOKENS,
    INTERNVL_NAMED_TOKENS,
    OVIS2_INDICATOR_TOKENS,
    PERCEPTION_LM_NAMED_TOKENS,
    SMOLVLM_NAMED_TOKENS,
    special_token_ids,
)
from .deepseek_configs import DEEPSEEK_FAMILIES, deepseek_config_kwargs
from .hybrid_configs import liquid_config_kwargs, minicpmv_config_kwargs, recurrent_text
from .specs import (
    FAST_VLM_DOWNSAMPLE,
    GEMMA4_POOLING,
    HYBRID_FAMILIES,
    INTERNVL_FAMILIES,
    LLAVA15_FAMILIES,
    MINICPMV_FAMILIES,
    MISTRAL3_MERGE,
    MOE_EXPERTS,
    MOE_EXPERTS_PER_TOKEN,
    MOE_FAMILIES,
    QWEN3_FAMILIES,
    TILE_FAMILIES,
    ModelSpec,
    VisionLayout,
    pooled_tokens_per_crop,
    transformers_class,
)

_MROPE_SECTIONS = {
    16: [2, 3, 3],
    32: [4, 6, 6],
    64: [8, 12, 12],
}  # rotary half-dim split, Qwen2-VL's proportions
_QWEN3_MROPE_SECTIONS = {16: [4, 2, 2], 32: [6, 5, 5]}  # interleaved; 32: the real [24, 20, 20] / 4
_VISION_INIT_STD = 0.02
_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
"""One rotary table over 1-D positions (copied into each config: a config keeps the dict it is given)."""
OVIS2_VISUAL_VOCAB = 64
"""Rows of the fixtures' Ovis2 visual embedding table (the real models': 65,536)."""


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
def build_config(
    family: str,
    spec: ModelSpec,
    tokenizer: Qwen2Tokenizer,
    layout: VisionLayout,
    *,
    explicit_head_dim: bool = True,
) -> Any:
    """Builds the family's real config class for ``spec``.

    Args:
        family: One of :data:`FAMILIES` or :data:`MOE_FAMILIES`.
        spec: The model's shape.
        tokenizer: The pair's tokenizer (vocabulary size and special-token ids).
        layout: The processor's geometry (patch size; LLaVA-OneVision's crop side and pinpoints).
        explicit_head_dim: Whether the text config names ``head_dim`` (Qwen3-VL's always does); when not,
            transformers derives it as ``hidden // heads``.

    Returns:
        A ``Qwen2VLConfig``, ``Qwen2_5_VLConfig``, ``Qwen3VLConfig``, ``Qwen3VLMoeConfig``,
        ``LlavaOnevisionConfig`` or ``InternVLConfig``.
    """
    tid = tokenizer.convert_tokens_to_ids
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.hidden // spec.head_dim,
        # Qwen3's and Qwen3.5's text configs (MiniCPM-V's is Qwen3.5's) default head_dim to their own
        **(
            {"head_dim": spec.head_dim}
            if explicit_head_dim or family in (*QWEN3_FAMILIES, *MINICPMV_FAMILIES)
            else {}
        ),
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 4096,
        "initializer_range": spec.init_std,
        "pad_token_id": tid("<|endoftext|>"),
        "eos_token_id": tid("<|im_end|>"),
        "bos_token_id": tid("<|endoftext|>"),
    }
    if family in MOE_FAMILIES:  # every layer sparse, experts half the dense width each
        text |= {"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_EXPERTS_PER_TOKEN}
        text |= {
            "moe_intermediate_size": spec.intermediate // 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if family in HYBRID_FAMILIES:
        text |= recurrent_text(family, spec)
    config_cls = transformers_class(family, 0)
    if family == "llava_onevision":
        return config_cls(**_llava_config_kwargs(spec, text, tid, layout))
    if family in INTERNVL_FAMILIES:
        return config_cls(**_internvl_config_kwargs(spec, text, tid, layout, sparse=family in MOE_FAMILIES))
    if family == "gemma3":
        return config_cls(**_gemma3_config_kwargs(spec, text, tid, layout))
    if family == "gemma4":
        return config_cls(**_gemma4_config_kwargs(spec, text, tid, layout))
    if family in LLAVA15_FAMILIES:
        return config_cls(**_llava15_config_kwargs(family, spec, text, tid, layout))
    if family == "mistral3":
        return config_cls(**_mistral3_config_kwargs(spec, text, tid, layout))
    if family == "glm46v":
        return config_cls(**_glm_v_config_kwargs(spec, text, tid, layout))
    if family == "aya_vision":
        return config_cls(**_aya_vision_config_kwargs(spec, text, tid, layout))
    if family == "ovis2":
        return config_cls(**_ovis2_config_kwargs(spec, text, tid, layout))
    if family in DEEPSEEK_FAMILIES:
        tower = _vision_tower(spec, layout, initializer_range=_VISION_INIT_STD)
        text |= {"model_type": "llama", "rope_parameters": dict(_PLAIN_ROPE)}
        return config_cls(**deepseek_config_kwargs(family, spec, text, tid, layout, tower))
    if family == "video_llama_3":
        return config_cls(**_video_llama3_config_kwargs(spec, text, tid, layout))
    if family == "perception_lm":
        return config_cls(**_perception_lm_config_kwargs(spec, text, tid, layout))
    if family == "fast_vlm":
        return config_cls(**_fast_vlm_config_kwargs(spec, text, tid, layout))
    vision = {**_vit_widths(spec), "initializer_range": _VISION_INIT_STD}
    if family in ("lfm2_vl", "lfm3_vl"):
        return config_cls(**liquid_config_kwargs(family, text, tid, layout, vision))
    if family in MINICPMV_FAMILIES:
        text |= {"rope_parameters": _mrope("qwen3_5", spec.head_dim)}  # Qwen3.5's
        return config_cls(**minicpmv_config_kwargs(family, text, tid, layout, vision))
    if family in TILE_FAMILIES:
        return config_cls(
            text_config={**text, "model_type": "llama"},
            vision_config=_vision_tower(spec, layout),
            scale_factor=2,  # 2 x 2 patches shuffled into one token (the real models: 4 x 4)
            image_token_id=tid(SMOLVLM_NAMED_TOKENS["image_token"]),
            pad_token_id=text["pad_token_id"],
            tie_word_embeddings=False,
        )
    return config_cls(
        text_config={**text, "rope_parameters": _mrope(family, spec.head_dim)},
        vision_config={
            "depth": spec.vision_layers,
            "num_heads": spec.vision_heads,
            "patch_size": layout.patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": _VISION_INIT_STD,
            **_qwen_vision_widths(family, spec),
        },
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def _llava_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``LlavaOnevisionConfig``'s arguments: a Qwen2 language model behind a SigLIP tower (no head)."""
    return {
        "text_config": {
            **text,
            "model_type": "qwen2",
            "rope_parameters": dict(_PLAIN_ROPE),
        },
        "vision_config": _siglip_config(spec, layout),
        "image_token_index": tid("<image>"),
        "video_token_index": tid("<video>"),
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "image_grid_pinpoints": layout.pinpoints(),
        "vision_aspect_ratio": "anyres_max_9",
        "tie_word_embeddings": False,
    }


def _llava15_config_kwargs(
    family: str, spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``LlavaConfig``'s arguments, LLaVA-1.5's: a Llama language model behind a CLIP tower whose second-to-last
    layer's patch features (CLS dropped) go through a two-layer projector, one token per patch; ``LlavaNextConfig``'s
    the same with the anyres grids (``layout``'s pinpoints); ``LlavaNextVideoConfig``'s with a video's frames'
    patches average-pooled 2 x 2."""
    extra = {} if family == "llava" else {"image_grid_pinpoints": layout.pinpoints()}
    if family == "llava_next_video":
        extra |= {
            "video_token_index": tid("<video>"),
            "spatial_pool_mode": "average",
            "spatial_pool_stride": 2,
        }
    return {
        **extra,
        "text_config": {
            **text,
            "model_type": "llama",
            "rope_parameters": dict(_PLAIN_ROPE),
        },
        "vision_config": _vision_tower(spec, layout, model_type="clip_vision_model"),
        "image_token_index": tid("<image>"),
        "image_seq_length": (layout.crop_side // layout.patch) ** 2,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "tie_word_embeddings": False,
    }


def _mistral3_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Mistral3Config``'s arguments, Ministral 3's: a Pixtral tower reading pictures of up to ``crop_side`` pixels,
    2 x 2 patches merged into one token, and a Ministral 3 language model whose YaRN RoPE starts from 32 positions, so
    that its queries' scale (Llama 4's, which grows past ``original_max_position_embeddings``) changes within a reply."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 128.0,  # max_position_embeddings / original_max_position_embeddings
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    }
    return {
        "text_config": {  # Ministral 3's head_dim defaults to 128, not hidden // heads
            **text,
            "model_type": "ministral3",
            "head_dim": spec.head_dim,
            "rope_parameters": rope,
            "sliding_window": None,
        },
        "vision_config": _vision_tower(spec, layout, model_type="pixtral"),
        "image_token_index": tid("[IMG]"),
        "spatial_merge_size": MISTRAL3_MERGE,
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
    }


def _glm_v_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Glm46VConfig``'s arguments, GLM-4.6V-Flash's: a ViT of ``patch`` pixels, 2 x 2 patches merged, in front of a
    GLM-4 language model whose M-RoPE turns half of each head, as GLM's does (``partial_rotary_factor`` 0.5)."""
    half = spec.head_dim // 4  # rotary pairs: half the head turns
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [half // 2, half // 4, half - half // 2 - half // 4],
    }
    return {
        "text_config": {**text, "model_type": "glm4v_text", "rope_parameters": rope},
        "vision_config": {
            "depth": spec.vision_layers,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden,
            "patch_size": layout.patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "image_size": 4
            * layout.patch,  # its learnt position table: 4 x 4 patches, interpolated to each grid
            "initializer_range": _VISION_INIT_STD,
        },
        "image_token_id": tid("<|image|>"),
        "video_token_id": tid("<|video|>"),
        "image_start_token_id": tid("<|begin_of_image|>"),
        "image_end_token_id": tid("<|end_of_image|>"),
        "video_start_token_id": tid("<|begin_of_video|>"),
        "video_end_token_id": tid("<|end_of_video|>"),
        "tie_word_embeddings": False,
    }


def _siglip_config(spec: ModelSpec, layout: VisionLayout) -> dict[str, Any]:
    """A SigLIP vision tower's config (LLaVA-OneVision's and Gemma 3's): crops of ``crop_side`` pixels, no head."""
    return _vision_tower(spec, layout, model_type="siglip_vision_model", vision_use_head=False)


def _vision_tower(spec: ModelSpec, layout: VisionLayout, **extra: Any) -> dict[str, Any]:
    """A ViT tower's config (SigLIP, CLIP, SmolVLM's): ``spec``'s widths, crops of ``crop_side`` pixels."""
    return {
        **_vit_widths(spec),
        "image_size": layout.crop_side,
        "patch_size": layout.patch,
        **extra,
    }


def _vit_widths(spec: ModelSpec) -> dict[str, int]:
    """A vision transformer's widths, depth and heads from ``spec`` (its MLP twice its width)."""
    return {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": 2 * spec.vision_hidden,
        "num_hidden_layers": spec.vision_layers,
        "num_attention_heads": spec.vision_heads,
    }


def _internvl_config_kwargs(
    spec: ModelSpec,
    text: dict[str, Any],
    tid: Callable[[str], int],
    layout: VisionLayout,
    sparse: bool = False,
) -> dict[str, Any]:
    """``InternVLConfig``'s arguments: a Qwen2 language model behind an InternViT tower, whose patch features are
    pixel-shuffled (2 x 2 into one) and projected (InternVL3's; InternVL3.5's language model is Qwen3); ``sparse``:
    a Qwen3 mixture-of-experts language model (InternVL3.5-30B-A3B's)."""
    sparse_text = (
        {"model_type": "qwen3_moe", "head_dim": spec.head_dim} if sparse else {"model_type": "qwen2"}
    )
    return {
        "text_config": {
            **text,
            **sparse_text,
            "rope_parameters": dict(_PLAIN_ROPE),
        },
        "vision_config": {
            **_vit_widths(spec),
            "image_size": [layout.crop_side, layout.crop_side],
            "patch_size": [layout.patch, layout.patch],
            "initializer_range": _VISION_INIT_STD,
            # InternViT scales each block's output by a learned factor, 0.1 at init; a random tower's blocks would
            # then barely touch the patch embeddings and every picture would look alike to the language model.
            "layer_scale_init_value": 1.0,
        },
        "image_token_id": tid(INTERNVL_NAMED_TOKENS["context_image_token"]),
        "image_seq_length": pooled_tokens_per_crop(layout),
        "downsample_ratio": 0.5,
        "tie_word_embeddings": False,
    }


def _gemma3_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Gemma3Config``'s arguments: a Gemma 3 language model (local sliding-window layers, the last layer global,
    as the real models interleave five local layers per global one) behind a SigLIP tower whose patches are
    average-pooled and projected, the local layers' window :attr:`ModelSpec.sliding_window` tokens."""
    layer_types = ["sliding_attention"] * (spec.layers - 1) + ["full_attention"]
    return {
        "text_config": {
            **text,
            "head_dim": spec.head_dim,
            "query_pre_attn_scalar": spec.head_dim,
            "sliding_window": spec.sliding_window,
            "layer_types": layer_types,
        },
        "vision_config": _siglip_config(spec, layout),
        "mm_tokens_per_image": pooled_tokens_per_crop(layout),
        "boi_token_index": tid(GEMMA3_NAMED_TOKENS["boi_token"]),
        "eoi_token_index": tid(GEMMA3_NAMED_TOKENS["eoi_token"]),
        "image_token_index": tid(GEMMA3_NAMED_TOKENS["image_token"]),
        "tie_word_embeddings": False,
    }


def _gemma4_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Gemma4Config``'s arguments: a Gemma 4 language model with every feature the real sizes have between them
    (E2B's and E4B's per-layer inputs and last layers reusing earlier layers' keys, 31B's both-ways attention over
    a picture's tokens in the local layers, keys that are the values in the global layers, wider global heads,
    softcapped logits), local (sliding-window) and global layers alternating, behind Gemma 4's tower, whose patches
    are pooled :data:`GEMMA4_POOLING` x :data:`GEMMA4_POOLING` into a token. A model of two layers or fewer reuses no
    keys (both kinds of layer must come before the first that reuses one)."""
    layer_types = ["full_attention" if i % 2 else "sliding_attention" for i in range(spec.layers)]
    vision_heads = spec.vision_heads
    return {
        "text_config": {
            **text,
            "head_dim": spec.head_dim,
            "global_head_dim": 2 * spec.head_dim,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": spec.sliding_window,
            "layer_types": layer_types,
            "num_kv_shared_layers": max(spec.layers - 2, 0),
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": text["vocab_size"],
            "use_bidirectional_attention": "vision",
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": False,
        },
        "vision_config": {
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": vision_heads,
            "num_key_value_heads": vision_heads,
            "head_dim": spec.vision_hidden // vision_heads,
            "patch_size": layout.patch,
            "pooling_kernel_size": GEMMA4_POOLING,
            "position_embedding_size": 64,  # patch coordinates up to 64 a side
            "initializer_range": _VISION_INIT_STD,
        },
        "audio_config": None,
        "image_token_id": tid(GEMMA4_NAMED_TOKENS["image_token"]),
        "video_token_id": tid("<|video|>"),
        "boi_token_id": tid(GEMMA4_NAMED_TOKENS["boi_token"]),
        "eoi_token_id": tid(GEMMA4_NAMED_TOKENS["eoi_token"]),
        "audio_token_id": tid(GEMMA4_NAMED_TOKENS["audio_token"]),
        "boa_token_id": tid(GEMMA4_NAMED_TOKENS["boa_token"]),
        "eoa_token_index": tid(GEMMA4_NAMED_TOKENS["eoa_token"]),
        "tie_word_embeddings": False,
    }


def _aya_vision_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``AyaVisionConfig``'s arguments: a Cohere2 language model (Command R7B's: three sliding-window layers per
    global one, the window :attr:`ModelSpec.sliding_window` tokens) behind a SigLIP tower whose patch features are
    pixel-shuffled (2 x 2 into one) and projected by a SwiGLU, as Aya Vision 8B's. The logits are not scaled down
    (the real model's ``logit_scale`` 0.0625 would leave a random fixture's greedy choices near ties)."""
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(spec.layers)]
    return {
        "text_config": {
            **text,
            "model_type": "cohere2",
            "head_dim": spec.head_dim,
            "sliding_window": spec.sliding_window,
            "layer_types": layer_types,
            "logit_scale": 1.0,
        },
        "vision_config": _siglip_config(spec, layout),
        "downsample_factor": 2,
        "vision_feature_select_strategy": "full",
        "image_token_index": tid("<|IMG_PATCH|>"),
        "tie_word_embeddings": False,
    }


def _perception_lm_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``PerceptionLMConfig``'s arguments: a Llama language model behind timm's Perception Encoder (``vit_pe_core``,
    ``spec``'s widths, tiles of ``crop_side`` pixels, its CLS token dropped), the projected patches pooled 2 x 2, as
    every Perception LM size's."""
    model_args = {
        "embed_dim": spec.vision_hidden,
        "depth": spec.vision_layers,
        "num_heads": spec.vision_heads,
        "img_size": [layout.crop_side, layout.crop_side],
        "patch_size": layout.patch,
    }
    return {
        "text_config": {**text, "model_type": "llama", "rope_parameters": dict(_PLAIN_ROPE)},
        "vision_config": {
            "model_type": "timm_wrapper",
            "architecture": "vit_pe_core_tiny_patch16_384",
            "model_args": model_args,
            "do_pooling": False,
            "initializer_range": _VISION_INIT_STD,
        },
        "vision_use_cls_token": True,
        "projector_pooling_ratio": 2,
        "image_token_id": tid(PERCEPTION_LM_NAMED_TOKENS["image_token"]),
        "video_token_id": tid(PERCEPTION_LM_NAMED_TOKENS["video_token"]),
        "tie_word_embeddings": False,
    }


def _fast_vlm_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``FastVlmConfig``'s arguments: a Qwen2 language model (every FastVLM size's) behind timm's FastViTHD
    (``fastvit_mci3``: three convolutional stages, two attention stages, the last widened 2x by its final
    convolution), one stage block each at ``spec``'s vision width (attention heads of 32), a token per 64 x 64
    pixels through a two-layer projector, as the transformers conversions have it."""
    width = max(32, spec.vision_hidden)  # the attention stages' heads are 32 wide
    return {
        "text_config": {**text, "model_type": "qwen2"},
        "vision_config": {
            "model_type": "timm_wrapper",
            "architecture": "fastvit_mci3",
            "model_args": {
                "inference_mode": True,
                "layers": (1, 1, 1, 1, 1),
                "embed_dims": (width // 2, width, width, width, width),
                "mlp_ratios": (2, 2, 2, 2, 2),
            },
            "do_pooling": False,
            "hidden_size": 2 * width,  # the final convolution's
            "initializer_range": _VISION_INIT_STD,
        },
        "image_token_index": tid("<image>"),
        "image_seq_length": (layout.crop_side // FAST_VLM_DOWNSAMPLE) ** 2,
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
    }


def _ovis2_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Ovis2Config``'s arguments: a Qwen2 language model (Qwen2.5's, as every Ovis2 size's) behind Ovis2's tower,
    whose patch features are strided 2 x 2 into one and read as a distribution over a visual vocabulary, each token
    the expected row of the visual embedding table (:data:`OVIS2_VISUAL_VOCAB` rows, the last five the indicators')."""
    return {
        "text_config": {**text, "model_type": "qwen2"},
        "vision_config": _vision_tower(
            spec, layout, hidden_stride=2, vocab_size=OVIS2_VISUAL_VOCAB, initializer_range=_VISION_INIT_STD
        ),
        "image_token_id": tid("<IMG_ATOM>"),
        "visual_indicator_token_ids": [tid(token) for token in OVIS2_INDICATOR_TOKENS],
        "vocab_size": text["vocab_size"],
        "hidden_size": spec.hidden,
        "tie_word_embeddings": False,
    }


def _video_llama3_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``VideoLlama3Config``'s arguments: a Qwen2 language model (Qwen2.5's, as both VideoLLaMA3 sizes') with 1-D
    rotary positions behind VideoLLaMA3's tower (patches of ``patch`` pixels, 2-D rotary positions, any picture
    size) and a two-layer projector."""
    return {
        "text_config": {
            **text,
            "model_type": "qwen2",
            "rope_parameters": dict(_PLAIN_ROPE),
        },
        "vision_config": {
            **_vit_widths(spec),
            "patch_size": layout.patch,
            "initializer_range": _VISION_INIT_STD,
        },
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "tie_word_embeddings": False,
    }


def _mrope(family: str, head_dim: int) -> dict[str, Any]:
    """The Qwen family's multimodal rotary settings (Qwen3-VL interleaves the sections)."""
    rope: dict[str, Any] = dict(_PLAIN_ROPE)
    if family in QWEN3_FAMILIES:
        return {**rope, "mrope_section": _QWEN3_MROPE_SECTIONS[head_dim], "mrope_interleaved": True}
    return {**rope, "mrope_section": _MROPE_SECTIONS[head_dim]}


def _qwen_vision_widths(family: str, spec: ModelSpec) -> dict[str, Any]:
    """The vision-config entries each Qwen family names its own way (widths, windows, deepstack)."""
    if family == "qwen2_vl":
        return {"embed_dim": spec.vision_hidden, "hidden_size": spec.hidden, "mlp_ratio": 2}
    widths = {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": 2 * spec.vision_hidden,
        "out_hidden_size": spec.hidden,
    }
    if family == "qwen2_5_vl":
        return {
            **widths,
            "window_size": 56,
            "fullatt_block_indexes": [spec.vision_layers - 1],
            "tokens_per_second": 2,
        }
    return {**widths, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}


def generation_config(tokenizer: Qwen2Tokenizer) -> GenerationConfig:
    """Greedy generation that stops at ``<|im_end|>`` (or ``<|endoftext|>``)."""
    from transformers import GenerationConfig

    ids = special_token_ids(tokenizer, ())
    return GenerationConfig(
        eos_token_id=[ids["eos"], ids["pad"]],
        pad_token_id=ids["pad"],
        bos_token_id=ids["pad"],
        do_sample=False,
    )
