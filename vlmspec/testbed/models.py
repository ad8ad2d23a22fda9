"""Model shapes of the testbed pairs and the families' real config classes built from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from .tokenizer import LLAVA_PATCH, QWEN_PATCH, check_family, special_token_ids
from .world import IMAGE_SIDE

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

__all__ = ["ModelSpec", "build_model", "count_parameters", "generation_config", "model_class"]

_MROPE_SECTIONS = {
    16: [2, 3, 3],
    32: [4, 6, 6],
    64: [8, 12, 12],
}  # rotary half-dim split, Qwen2-VL's proportions


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one testbed model (language model + vision tower).

    Attributes:
        hidden: Language-model width (a multiple of ``head_dim``).
        layers: Decoder layers.
        kv_heads: Key/value heads (grouped-query attention; divides ``hidden // head_dim``).
        intermediate: MLP width.
        vision_hidden: Vision-tower width (a multiple of ``vision_heads``).
        vision_layers: Vision-tower layers.
        vision_heads: Vision-tower attention heads.
        head_dim: Language-model attention head width (16, 32 or 64).
        init_std: Standard deviation of the language model's initial weights.
    """

    hidden: int
    layers: int
    kv_heads: int
    intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    head_dim: int = 32
    init_std: float = 0.02

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def model_class(family: str) -> type[PreTrainedModel]:
    """The family's ``*ForConditionalGeneration`` class."""
    import transformers

    check_family(family)
    name = (
        "Qwen2VLForConditionalGeneration"
        if family == "qwen2_vl"
        else "LlavaOnevisionForConditionalGeneration"
    )
    return getattr(transformers, name)


def build_config(family: str, spec: ModelSpec, tokenizer: Qwen2Tokenizer) -> Any:
    """Builds the family's real config class for ``spec``.

    Args:
        family: ``"qwen2_vl"`` or ``"llava_onevision"``.
        spec: The model's shape.
        tokenizer: The pair's tokenizer (vocabulary size and special-token ids).

    Returns:
        A ``Qwen2VLConfig`` or ``LlavaOnevisionConfig``.
    """
    check_family(family)
    ids = special_token_ids(tokenizer, family)
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.hidden // spec.head_dim,
        "head_dim": spec.head_dim,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 4096,
        "initializer_range": spec.init_std,
        "pad_token_id": ids["pad"],
        "eos_token_id": ids["eos"],
        "bos_token_id": ids["pad"],
    }
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig(
            text_config={
                **text,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": _MROPE_SECTIONS[spec.head_dim],
                },
            },
            vision_config={
                "depth": spec.vision_layers,
                "embed_dim": spec.vision_hidden,
                "hidden_size": spec.hidden,
                "mlp_ratio": 2,
                "num_heads": spec.vision_heads,
                "patch_size": QWEN_PATCH,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "initializer_range": 0.02,
            },
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
    from transformers import LlavaOnevisionConfig

    side = IMAGE_SIDE
    return LlavaOnevisionConfig(
        text_config={
            **text,
            "model_type": "qwen2",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "image_size": side,
            "patch_size": LLAVA_PATCH,
            "vision_use_head": False,
        },
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        image_grid_pinpoints=[[side, side]],
        vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=False,
    )


def generation_config(tokenizer: Qwen2Tokenizer, family: str) -> GenerationConfig:
    """Greedy generation that stops at ``<|im_end|>`` (or ``<|endoftext|>``)."""
    from transformers import GenerationConfig

    ids = special_token_ids(tokenizer, family)
    return GenerationConfig(
        eos_token_id=[ids["eos"], ids["pad"]],
        pad_token_id=ids["pad"],
        bos_token_id=ids["pad"],
        do_sample=False,
    )


def build_model(family: str, spec: ModelSpec, tokenizer: Qwen2Tokenizer) -> PreTrainedModel:
    """A freshly initialised model of ``spec`` (draws from torch's global RNG; seed it first)."""
    model = model_class(family)(build_config(family, spec, tokenizer))
    model.generation_config = generation_config(tokenizer, family)
    return model


def count_parameters(model: PreTrainedModel) -> dict[str, int]:
    """Parameter counts: ``total``, ``vision`` (tower + projector/merger) and ``language`` (the rest)."""
    total = sum(p.numel() for p in model.parameters())
    vision = sum(
        p.numel() for n, p in model.named_parameters() if "visual" in n or "vision" in n or "projector" in n
    )
    return {"total": total, "vision": vision, "language": total - vision}
