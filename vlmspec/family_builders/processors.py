"""The families' real processor classes around a fixture tokenizer, with a :class:`VisionLayout`'s geometry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import ProcessorMixin
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from .chat import SMOLVLM_GRID
from .deepseek_configs import DEEPSEEK_FAMILIES, HIGH_RES_SIDE
from .hybrid_configs import LFM2_VL_TOKENS
from .specs import (
    FAST_VLM_DOWNSAMPLE,
    GEMMA4_POOLING,
    GEMMA4_SOFT_TOKENS,
    INTERNVL_FAMILIES,
    LLAVA15_FAMILIES,
    MINICPMV_FAMILIES,
    MISTRAL3_MERGE,
    QWEN3_FAMILIES,
    TILE_FAMILIES,
    VisionLayout,
    pooled_tokens_per_crop,
    transformers_class,
)


# ---------------------------------------------------------------------------------------------
# Processor
# ---------------------------------------------------------------------------------------------
def build_processor(family: str, tokenizer: Qwen2Tokenizer, layout: VisionLayout) -> ProcessorMixin:
    """Builds the family's real processor class around ``tokenizer`` with ``layout``'s geometry.

    Returns:
        A ``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``, ``LlavaOnevisionProcessor`` or
        ``InternVLProcessor`` with the tokenizer's chat template.
    """
    processor_cls = transformers_class(family, 2)
    if family in TILE_FAMILIES:
        import transformers

        tile = {"longest_edge": layout.crop_side}
        image_processor = getattr(
            transformers, "SmolVLMImageProcessor" if family == "smolvlm" else "Idefics3ImageProcessor"
        )
        videos = {}
        if family == "smolvlm":  # a frame: one tile
            videos["video_processor"] = transformers.SmolVLMVideoProcessor(
                size=tile, max_image_size=tile, do_sample_frames=False
            )
        return processor_cls(  # a picture resized to at most a grid of tiles and cut into them
            image_processor=image_processor(
                do_image_splitting=True,
                size={"longest_edge": SMOLVLM_GRID * layout.crop_side},
                max_image_size=tile,
            ),
            tokenizer=tokenizer,
            image_seq_len=pooled_tokens_per_crop(layout),
            chat_template=tokenizer.chat_template,
            **videos,
        )
    if family == "glm46v":
        from transformers import Glm46VImageProcessor, Glm46VVideoProcessor

        geometry = {"patch_size": layout.patch, "temporal_patch_size": 2, "merge_size": 2}
        return processor_cls(  # Qwen2-VL's resizing: whole merged patches within the pixel ranges
            image_processor=Glm46VImageProcessor(size=_pixel_range(layout.image_pixels), **geometry),
            tokenizer=tokenizer,
            video_processor=Glm46VVideoProcessor(
                size=_pixel_range(layout.video_pixels),
                max_image_size={"longest_edge": layout.video_pixels[1]},
                do_sample_frames=False,
                **geometry,
            ),
            chat_template=tokenizer.chat_template,
        )
    if family == "mistral3":
        from transformers import PixtralImageProcessor

        return processor_cls(  # a picture resized to whole merged patches, its longest side at most crop_side
            image_processor=PixtralImageProcessor(size={"longest_edge": layout.crop_side}),
            tokenizer=tokenizer,
            patch_size=layout.patch,
            spatial_merge_size=MISTRAL3_MERGE,
            chat_template=tokenizer.chat_template,
        )
    if family in LLAVA15_FAMILIES:
        from transformers import CLIPImageProcessor, LlavaNextImageProcessor, LlavaNextVideoVideoProcessor

        side = layout.crop_side
        crops = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
        videos = (
            {"video_processor": LlavaNextVideoVideoProcessor(**crops)} if family == "llava_next_video" else {}
        )
        return processor_cls(  # CLIP's CLS token goes ("default" strategy): one token per patch
            image_processor=CLIPImageProcessor(**crops)
            if family == "llava"
            else LlavaNextImageProcessor(**crops, image_grid_pinpoints=layout.pinpoints()),
            **videos,
            tokenizer=tokenizer,
            patch_size=layout.patch,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=tokenizer.chat_template,
        )
    if family == "fast_vlm":  # LLaVA's processor over FastViTHD's grid: a token per 64 x 64 pixels, no CLS
        from transformers import CLIPImageProcessor

        side = layout.crop_side
        return processor_cls(
            image_processor=CLIPImageProcessor(
                size={"shortest_edge": side},
                crop_size={"height": side, "width": side},
                image_mean=[0.0, 0.0, 0.0],
                image_std=[1.0, 1.0, 1.0],
            ),
            tokenizer=tokenizer,
            patch_size=FAST_VLM_DOWNSAMPLE,
            chat_template=tokenizer.chat_template,
        )
    if family == "gemma3":
        from transformers import Gemma3ImageProcessor

        side = {"height": layout.crop_side, "width": layout.crop_side}
        return processor_cls(
            image_processor=Gemma3ImageProcessor(size=side),
            tokenizer=tokenizer,
            image_seq_length=pooled_tokens_per_crop(layout),
            chat_template=tokenizer.chat_template,
        )
    if (
        family == "gemma4"
    ):  # pictures and frames at their aspect ratio, as many tokens as fit GEMMA4_SOFT_TOKENS
        from transformers import Gemma4AudioFeatureExtractor, Gemma4ImageProcessor, Gemma4VideoProcessor

        geometry = {
            "patch_size": layout.patch,
            "pooling_kernel_size": GEMMA4_POOLING,
            "max_soft_tokens": GEMMA4_SOFT_TOKENS,
        }
        return processor_cls(
            feature_extractor=Gemma4AudioFeatureExtractor(),  # the processor takes one; audio is not read
            image_processor=Gemma4ImageProcessor(**geometry),
            tokenizer=tokenizer,
            video_processor=Gemma4VideoProcessor(**geometry, do_sample_frames=False),
            chat_template=tokenizer.chat_template,
        )
    if family in INTERNVL_FAMILIES:
        from transformers import GotOcr2ImageProcessor, InternVLVideoProcessor

        side = {"height": layout.crop_side, "width": layout.crop_side}
        return processor_cls(
            image_processor=GotOcr2ImageProcessor(
                size=side, crop_to_patches=True, max_patches=layout.max_tiles
            ),
            tokenizer=tokenizer,
            video_processor=InternVLVideoProcessor(size=side, do_sample_frames=False),
            image_seq_length=pooled_tokens_per_crop(layout),
            chat_template=tokenizer.chat_template,
        )
    if family == "aya_vision":  # tiles of crop_side pixels (plus the whole picture), patches merged 2 x 2
        from transformers import GotOcr2ImageProcessor

        side = {"height": layout.crop_side, "width": layout.crop_side}
        return processor_cls(
            image_processor=GotOcr2ImageProcessor(
                size=side, crop_to_patches=True, max_patches=layout.max_tiles
            ),
            tokenizer=tokenizer,
            patch_size=layout.patch,
            img_size=layout.crop_side,
            downsample_factor=2,
            chat_template=tokenizer.chat_template,
        )
    if (
        family == "perception_lm"
    ):  # a thumbnail and up to max_tiles tiles of crop_side; a video's frames a tile each
        from transformers import PerceptionLMImageProcessor, PerceptionLMVideoProcessor

        side = layout.crop_side
        return processor_cls(
            image_processor=PerceptionLMImageProcessor(tile_size=side, max_num_tiles=layout.max_tiles),
            video_processor=PerceptionLMVideoProcessor(
                size={"height": side, "width": side}, do_sample_frames=False
            ),
            tokenizer=tokenizer,
            patch_size=layout.patch,
            pooling_ratio=2,
            chat_template=tokenizer.chat_template,
        )
    if family == "lfm2_vl":
        return _lfm2_vl_processor(processor_cls, tokenizer, layout)
    if family in MINICPMV_FAMILIES:  # a picture whole near crop_side pixels a side and up to max_tiles slices
        from transformers import MiniCPMV4_6ImageProcessor, MiniCPMV4_6VideoProcessor

        geometry = {"patch_size": layout.patch, "scale_resolution": layout.crop_side}
        return processor_cls(
            image_processor=MiniCPMV4_6ImageProcessor(**geometry, max_slice_nums=layout.max_tiles),
            video_processor=MiniCPMV4_6VideoProcessor(**geometry, max_slice_nums=1, do_sample_frames=False),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    if family in DEEPSEEK_FAMILIES:  # a picture padded to a square of crop_side pixels, a token per patch
        return processor_cls(
            image_processor=_deepseek_image_processor(family, layout),
            tokenizer=tokenizer,
            num_image_tokens=(layout.crop_side // layout.patch) ** 2,
            chat_template=tokenizer.chat_template,
        )
    if family == "ovis2":  # the whole picture, then (when it is cut into several) tiles of crop_side pixels
        from transformers import Ovis2ImageProcessor

        side = {"height": layout.crop_side, "width": layout.crop_side}
        return processor_cls(
            image_processor=Ovis2ImageProcessor(
                size=side, crop_to_patches=True, max_patches=layout.max_tiles
            ),
            tokenizer=tokenizer,
            image_seq_length=(layout.crop_side // (layout.patch * 2)) ** 2,  # patches strided 2 x 2
            chat_template=tokenizer.chat_template,
        )
    if family == "video_llama_3":
        # pictures at their own size, a token per patch; a video's frames merged 2 x 2, then compressed
        from transformers import VideoLlama3ImageProcessor, VideoLlama3VideoProcessor

        return processor_cls(
            image_processor=VideoLlama3ImageProcessor(
                size=_pixel_range(layout.image_pixels), patch_size=layout.patch
            ),
            tokenizer=tokenizer,
            video_processor=VideoLlama3VideoProcessor(
                size=_pixel_range(layout.video_pixels), patch_size=layout.patch, do_sample_frames=False
            ),
            chat_template=tokenizer.chat_template,
        )
    if family == "llava_onevision":
        from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionVideoProcessor

        side = layout.crop_side
        return processor_cls(
            image_processor=LlavaOnevisionImageProcessor(
                size={"height": side, "width": side}, image_grid_pinpoints=layout.pinpoints()
            ),
            tokenizer=tokenizer,
            video_processor=LlavaOnevisionVideoProcessor(
                size={"height": side, "width": side}, do_sample_frames=False
            ),
            num_image_tokens=(side // layout.patch) ** 2,
            vision_feature_select_strategy="full",
            chat_template=tokenizer.chat_template,
            vision_aspect_ratio="anyres_max_9",
        )
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    geometry: dict[str, Any] = {"patch_size": layout.patch, "temporal_patch_size": 2, "merge_size": 2}
    qwen3 = family in QWEN3_FAMILIES
    normalisation = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]} if qwen3 else {}
    video_cls = (
        Qwen3VLVideoProcessor if qwen3 or family == "lfm3_vl" else Qwen2VLVideoProcessor
    )  # LFM3-VL's too
    return processor_cls(
        image_processor=Qwen2VLImageProcessor(
            size=_pixel_range(layout.image_pixels), **geometry, **normalisation
        ),
        tokenizer=tokenizer,
        video_processor=video_cls(
            size=_pixel_range(layout.video_pixels),
            **geometry,
            min_frames=2,
            max_frames=16,
            do_sample_frames=False,
            cap_pixels_per_frame=False,
        ),
        chat_template=tokenizer.chat_template,
    )


def _pixel_range(pixels: tuple[int, int]) -> dict[str, int]:
    return {"shortest_edge": pixels[0], "longest_edge": pixels[1]}


def _lfm2_vl_processor(processor_cls: Any, tokenizer: Qwen2Tokenizer, layout: VisionLayout) -> ProcessorMixin:
    """LFM2-VL's: a picture read whole at its own aspect ratio (between :data:`LFM2_VL_TOKENS` tokens of 2 x 2
    patches), or, when larger, cut into 2 to ``max_tiles`` tiles of ``crop_side`` pixels plus a thumbnail."""
    from transformers import Lfm2VlImageProcessor

    fewest, most = LFM2_VL_TOKENS
    return processor_cls(
        image_processor=Lfm2VlImageProcessor(
            encoder_patch_size=layout.patch,
            tile_size=layout.crop_side,
            min_image_tokens=fewest,
            max_image_tokens=most,
            max_tiles=layout.max_tiles,
        ),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def _deepseek_image_processor(family: str, layout: VisionLayout) -> Any:
    """Janus's, DeepSeek-VL's or its hybrid tower's image processor: a picture padded to a square of ``crop_side``
    pixels (the hybrid's again at the SAM encoder's :data:`HIGH_RES_SIDE`)."""
    from transformers import DeepseekVLHybridImageProcessor, DeepseekVLImageProcessor, JanusImageProcessor

    side = {"height": layout.crop_side, "width": layout.crop_side}
    if family == "deepseek_vl_hybrid":
        high = {"height": HIGH_RES_SIDE, "width": HIGH_RES_SIDE}
        return DeepseekVLHybridImageProcessor(size=side, high_res_size=high)
    return (JanusImageProcessor if family == "janus" else DeepseekVLImageProcessor)(size=side)
