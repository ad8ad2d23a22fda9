"""The families these builders know, their transformers classes, and the shapes and pixel geometry a builder is
given (:class:`ModelSpec`, :class:`VisionLayout`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "internvl")
"""The dense families with pictures and videos these builders know (the fixtures' test matrix)."""
IMAGE_ONLY_FAMILIES: tuple[str, ...] = (
    "gemma3",
    "llava",
    "llava_next",
    "idefics3",
    "mistral3",
    "aya_vision",
    "ovis2",
    "janus",
    "deepseek_vl",
    "deepseek_vl_hybrid",
    "lfm2_vl",
    "fast_vlm",
)
"""Families these builders know whose models read pictures only (Gemma 3, LLaVA-1.5, LLaVA-NeXT, Idefics3, Mistral
3, Aya Vision, Ovis2, Janus, DeepSeek-VL (and its hybrid tower), LFM2-VL, FastVLM: no video input), tested on their
own."""
OWN_TEST_FAMILIES: tuple[str, ...] = (
    "smolvlm",
    "llava_next_video",
    "glm46v",
    "video_llama_3",
    "gemma4",
    "perception_lm",
    "qwen3_5",
    "lfm3_vl",
    "minicpmv4_6",
    "minicpmv4_7",
)
"""Families with pictures and videos these builders know that are tested on their own (SmolVLM2: pictures cut into
tiles, a video's frames written as pictures with their times; LLaVA-NeXT-Video: LLaVA-NeXT's pictures, a video's
frames pooled; GLM-4.6V: Qwen2-VL's design, a video's frames written with the pictures' placeholder; VideoLLaMA3:
Qwen2-VL's flat patches, a video's frames merged and compressed, 1-D positions; Gemma 4: pictures and frames at
their own aspect ratio, per-layer inputs, layers reusing earlier layers' keys; Perception LM: a timm tower, pictures
cut into tiles, a video's frames a tile each; Qwen3.5: Qwen3-VL's tower and processor, a language model of recurrent
Gated DeltaNet layers and attention layers; LFM3-VL: Qwen2-VL's patches and Qwen3-VL's video processor, a language
model of short convolutions, sliding-window and global attention layers, 1-D positions; MiniCPM-V 4.6: NaViT-packed
pictures, slices and frames, Qwen3.5's language model with 1-D positions; MiniCPM-V 4.7: the same with Canvas
M-RoPE)."""
MOE_FAMILIES: tuple[str, ...] = ("qwen3_vl_moe", "internvl_moe")
"""Mixture-of-experts families these builders know too: Qwen3-VL-30B-A3B's and -235B-A22B's architecture, the
Qwen3-VL vision tower and processor with a sparse language model, and InternVL3.5-30B-A3B's and -241B-A28B's (model
type ``internvl``), InternVL's tower and processor with a sparse Qwen3 language model (every layer routes each token
to :data:`MOE_EXPERTS_PER_TOKEN` of :data:`MOE_EXPERTS` experts)."""
INTERNVL_FAMILIES: tuple[str, ...] = ("internvl", "internvl_moe")
"""The families with InternVL's tiles, tower and processor (dense and sparse language models)."""
QWEN3_FAMILIES: tuple[str, ...] = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
"""The families with Qwen3-VL's vision tower, processor and interleaved M-RoPE (Qwen3.5's tower has no deepstack)."""
HYBRID_FAMILIES: tuple[str, ...] = ("qwen3_5", "lfm2_vl", "lfm3_vl", "minicpmv4_6", "minicpmv4_7")
"""Families whose language model has recurrent layers beside its attention layers (Qwen3.5's Gated DeltaNet, its and
MiniCPM-V 4.6's and 4.7's; LFM2's and LFM3's short gated convolutions)."""
MINICPMV_FAMILIES: tuple[str, ...] = ("minicpmv4_6", "minicpmv4_7")
"""MiniCPM-V 4.6 and 4.7: one tower, processor and tokens (4.7 lays its positions out on a canvas)."""
FULL_ATTENTION_INTERVAL = 2
"""Hybrid fixtures: every second layer attends, and the last (the real Qwen3.5 models: every fourth; LFM2-1.2B: 6 of
16), so a 2-layer draft has one."""
LFM2_VL_GRID = 4
"""The most tiles a side of an LFM2-VL fixture picture is cut into (the ``<|img_row_r_col_c|>`` tokens named)."""
MOE_EXPERTS, MOE_EXPERTS_PER_TOKEN = 4, 2

_CLASS_PREFIXES = {  # family: the name of its transformers classes, <prefix>Config, ...ForConditionalGeneration
    "qwen2_vl": "Qwen2VL",
    "qwen2_5_vl": "Qwen2_5_VL",
    "qwen3_vl": "Qwen3VL",
    "qwen3_vl_moe": "Qwen3VLMoe",
    "llava_onevision": "LlavaOnevision",
    "internvl": "InternVL",
    "internvl_moe": "InternVL",
    "gemma3": "Gemma3",
    "gemma4": "Gemma4",
    "llava": "Llava",
    "llava_next": "LlavaNext",
    "llava_next_video": "LlavaNextVideo",
    "smolvlm": "SmolVLM",
    "idefics3": "Idefics3",
    "mistral3": "Mistral3",
    "glm46v": "Glm46V",
    "aya_vision": "AyaVision",
    "ovis2": "Ovis2",
    "janus": "Janus",
    "deepseek_vl": "DeepseekVL",
    "deepseek_vl_hybrid": "DeepseekVLHybrid",
    "video_llama_3": "VideoLlama3",
    "perception_lm": "PerceptionLM",
    "qwen3_5": "Qwen3_5",
    "lfm2_vl": "Lfm2Vl",
    "lfm3_vl": "Lfm3Vl",
    "minicpmv4_6": "MiniCPMV4_6",
    "minicpmv4_7": "MiniCPMV4_7",
    "fast_vlm": "FastVlm",
}
_PROCESSOR_PREFIXES = {
    "qwen3_vl_moe": "Qwen3VL",
    "qwen3_5": "Qwen3VL",
    "mistral3": "Pixtral",
    "fast_vlm": "Llava",
}
"""Families whose processor is another family's (...Processor)."""
TILE_FAMILIES = ("smolvlm", "idefics3")
"""SmolVLM2 and Idefics3 (SmolVLM 1): the same tokens, tiles and chat template; Idefics3 has no video processor."""
MISTRAL3_MERGE = 2
"""Mistral 3's ``spatial_merge_size`` in the fixtures (the real models': 2)."""
GEMMA4_POOLING, GEMMA4_SOFT_TOKENS = 2, 70
"""Gemma 4's fixtures: patches pooled 2 x 2 into a token (the real models: 3 x 3), at most 70 tokens a picture or a
video frame (the fewest Gemma 4's processors allow)."""
LLAVA15_FAMILIES = ("llava", "llava_next", "llava_next_video")
"""LLaVA-1.5 and its successors: a CLIP tower, a Llama language model, LLaVA-1.5's chat (NeXT-Video's with videos)."""
FAST_VLM_DOWNSAMPLE = 64
"""FastVLM's FastViTHD tower: a token per 64 x 64 pixels (a stride-4 stem, then four stages halving), the patch size
its processor counts tokens by (256 for the real models' 1024-pixel pictures)."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one model (language model + vision tower).

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
        sliding_window: Gemma 3: the local layers' attention window in tokens.
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
    sliding_window: int = 1024

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class VisionLayout:
    """Pixel geometry of a family's pictures, shared by its processor and its config.

    Attributes:
        patch: Side of a vision-transformer patch in pixels.
        image_pixels: Qwen families: ``(min, max)`` pixels of a resized image.
        video_pixels: Qwen families: ``(min, max)`` pixels of a resized video frame.
        crop_side: LLaVA-OneVision and InternVL: side of a crop (a tile; the vision tower's input) in pixels.
        anyres_tiles: LLaVA-OneVision: tiles per axis of the anyres grid pinpoints.
        max_tiles: InternVL: the most tiles a picture is cut into (a thumbnail of the whole picture is added when
            it is cut into several).
    """

    patch: int
    image_pixels: tuple[int, int] = (0, 0)
    video_pixels: tuple[int, int] = (0, 0)
    crop_side: int = 0
    anyres_tiles: tuple[int, ...] = (1,)
    max_tiles: int = 1

    def pinpoints(self) -> list[list[int]]:
        """LLaVA-OneVision's ``image_grid_pinpoints``: every ``tiles x tiles`` grid of crops."""
        side = self.crop_side
        return [[side * i, side * j] for i in self.anyres_tiles for j in self.anyres_tiles]


def transformers_class(family: str, which: int) -> Any:
    """The family's config (``which`` 0), model (1) or processor (2) class of transformers."""
    import transformers

    if which == 2:
        return getattr(transformers, _PROCESSOR_PREFIXES.get(family, _CLASS_PREFIXES[family]) + "Processor")
    return getattr(transformers, _CLASS_PREFIXES[family] + ("Config", "ForConditionalGeneration")[which])


def model_class(family: str) -> type[PreTrainedModel]:
    """The family's ``*ForConditionalGeneration`` class."""
    return transformers_class(family, 1)


def pooled_tokens_per_crop(layout: VisionLayout) -> int:
    """Visual tokens of one crop (an InternVL tile, a Gemma 3 picture): its patches, 2 x 2 of them merged into one
    (InternVL's pixel shuffle; Gemma 3's average pool, which takes the real model's 64 x 64 patches to 16 x 16)."""
    return (layout.crop_side // layout.patch) ** 2 // 4
