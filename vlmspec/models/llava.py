"""The LLaVA families: LLaVA-OneVision (:class:`LlavaOnevisionAdapter`), LLaVA-1.5 (:class:`LlavaAdapter`),
LLaVA-NeXT (:class:`LlavaNextAdapter`) and LLaVA-NeXT-Video (:class:`LlavaNextVideoAdapter`).

LLaVA-OneVision: a SigLIP tower + projector in front of a Qwen2 language model with 1-D RoPE.

Pruned/scored prefills (see :mod:`vlmspec.models.base`) take the visual features from the model's own
``get_image_features`` (anyres tiles, unpadding and ``image_newline`` packed as ``forward`` does) and
``get_video_features`` (pooled frames plus the trailing ``image_newline``); the config's defaults for the
vision-feature options apply, as in ``forward``. Positions are the original 1-D prompt indices.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from ..errors import InvalidInputError
from .base import NO_VIDEO_TOKEN, VLMAdapter
from .blocks import PlaceholderBlocks
from .data import VisualFeatures
from .media import equal_items_per_row, pictures_per_row, pictures_with_sizes

_PATCH_GRID_TOWERS = ("clip_vision_model", "siglip_vision_model")
"""Vision towers that read a picture as one fixed grid of patches (LLaVA's checkpoints with a Pixtral tower read
each picture at its own size: another layout, not supported)."""


class LlavaOnevisionAdapter(VLMAdapter):
    model_types = ("llava_onevision",)
    layout_fields = (  # crops of image_size pixels, patch_size patches each; anyres tiling and its cap
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "vision_feature_select_strategy",
        "image_grid_pinpoints",
        "vision_aspect_ratio",
    )
    fixed_processor_settings = frozenset(
        {"size", "crop_size", "do_resize", "do_center_crop"}
    )  # SigLIP's input

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        core = self.model.model
        found: dict[str, VisualFeatures] = {}
        if inputs.get("pixel_values") is not None:
            out = core.get_image_features(
                inputs["pixel_values"],
                inputs["image_sizes"],
                batch_num_images=inputs.get("batch_num_images"),
                return_dict=True,
            )
            found["image"] = VisualFeatures(embeds=torch.cat(out.pooler_output, dim=0))  # [n_image, D]
        if inputs.get("pixel_values_videos") is not None:
            out = core.get_video_features(inputs["pixel_values_videos"], return_dict=True)
            found["video"] = VisualFeatures(embeds=out.pooler_output.flatten(0, 1))  # [n_video, D]
        return found

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """One pixel row per item. ``batch_num_images`` stays the whole prompt's: it decides how every image of the
        prompt was tiled (a prompt with several images tiles none), which the placeholders already reflect."""
        found: dict[str, Any] = {}
        if inputs.get("pixel_values") is not None and range(inputs["pixel_values"].shape[0])[images]:
            found["pixel_values"] = inputs["pixel_values"][images]
            found["image_sizes"] = inputs["image_sizes"][images]
            if inputs.get("batch_num_images") is not None:
                found["batch_num_images"] = inputs["batch_num_images"]
        if (
            inputs.get("pixel_values_videos") is not None
            and range(inputs["pixel_values_videos"].shape[0])[videos]
        ):
            found["pixel_values_videos"] = inputs["pixel_values_videos"][videos]
        return found

    def row_media(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """A row's own ``batch_num_images``: the number of its images (which decided how they were tiled)."""
        found = self.media_items(inputs, images, videos)
        if "batch_num_images" in found:
            found["batch_num_images"] = found["batch_num_images"].new_tensor([images.stop - images.start])
        return found

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Images: ``batch_num_images`` holds one count per prompt that has images, in order (it is what the
        processor makes of ``images=[[...], [...]]``, one list per prompt). Videos: the videos of a batch share
        their frame count and size (``pixel_values_videos`` ``[N, F, C, H, W]``), so their placeholder counts."""
        image_id, video_id = self.visual_token_ids()
        ids = inputs["input_ids"]
        with_images = ((ids == image_id) & keep).any(-1).tolist()  # [B]
        per_prompt = inputs["batch_num_images"].tolist() if inputs.get("batch_num_images") is not None else []
        if inputs.get("pixel_values") is not None and len(per_prompt) != sum(with_images):
            raise InvalidInputError(
                f"batch_num_images has {len(per_prompt)} entries for {sum(with_images)} prompts with images; give "
                "the processor each prompt's images in its own list (images=[[a], [b, c]]) so they can be told apart"
            )
        counts = iter(per_prompt)
        images = [next(counts) if has else 0 for has in with_images]
        return list(zip(images, _video_counts(inputs, keep, video_id), strict=True))


class LlavaAdapter(PlaceholderBlocks):
    """LLaVA-1.5 (``llava-hf/llava-1.5-7b-hf`` drafting for ``-13b-hf``; or a LLaMA language model drafting, see
    :mod:`vlmspec.models.text`): a CLIP tower whose second-to-last layer's patch features go through a two-layer
    projector, one token per patch (576 for a 336-pixel picture), in front of a Llama language model with 1-D RoPE.

    Pictures only (a video reaches it as its frames: :func:`vlmspec.conversations.frames_as_pictures`). The processor
    resizes and centre-crops every picture to the tower's input and writes it as that many ``<image>`` tokens, one row
    of ``pixel_values`` ``[n, C, H, W]`` each: a prompt's media items are its pictures, blocks of a fixed size.
    Pruned/scored prefills take the features from the model's own ``get_image_features`` (the config's feature layer
    and strategy apply, as in ``forward``). Positions are the original 1-D prompt indices.
    """

    model_types = ("llava",)
    layout_fields = (  # pictures of image_size pixels, patch_size patches each, the CLS token dropped or kept
        "vision_config.model_type",
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "vision_feature_select_strategy",
    )
    fixed_processor_settings = frozenset({"size", "crop_size", "do_resize", "do_center_crop"})  # CLIP's input
    placeholder, block = "<image>", "picture"
    write_hint = "write each picture in the prompt as one <image> and let the processor expand it"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        _check_tower(self.config)

    @property
    def block_tokens(self) -> int:
        """Placeholders per picture: one per patch, plus the CLS token under the ``"full"`` strategy."""
        return _crop_tokens(self.config)

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        out = self.model.model.get_image_features(inputs["pixel_values"], return_dict=True)
        return {"image": VisualFeatures(embeds=torch.cat(list(out.pooler_output)))}  # [pictures * tokens, D]


class LlavaNextAdapter(VLMAdapter):
    """LLaVA-NeXT (LLaVA-1.6: ``llava-hf/llava-v1.6-vicuna-7b-hf`` drafting for ``-13b-hf``; a LLaMA language model
    for ``llama3-llava-next-8b-hf``): LLaVA-1.5's CLIP tower and projector, each picture read as a base crop of the
    whole plus the anyres grid of crops that best fits its size, whose features are unpadded to the picture's aspect
    with an ``image_newline`` after each row (``pack_image_features``). A picture's token count depends on its size.

    Pictures only (a video reaches it as its frames' pictures). ``pixel_values`` is ``[pictures, crops, C, H, W]``
    (padded to the most crops) with ``image_sizes`` ``[pictures, 2]``: a prompt's media items are its pictures. The
    pruned/scored prefills take the features from the model's own ``get_image_features`` (tiling, unpadding and
    newlines as ``forward`` packs them). Positions are the original 1-D prompt indices.
    """

    model_types = ("llava_next",)
    layout_fields = (  # crops of image_size pixels, patch_size patches each; the anyres grids
        "vision_config.model_type",
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "vision_feature_select_strategy",
        "image_grid_pinpoints",
    )
    fixed_processor_settings = frozenset(
        {"size", "crop_size", "do_resize", "do_center_crop", "image_grid_pinpoints"}
    )  # CLIP's input and the grids the model unpads with

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        _check_tower(self.config)

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, NO_VIDEO_TOKEN

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        pixels, sizes = inputs["pixel_values"], inputs["image_sizes"]
        out = self.model.model.get_image_features(pixels, sizes, return_dict=True)
        # one [tokens, D] per picture, as forward packs them
        return {"image": VisualFeatures(embeds=torch.cat(out.pooler_output, dim=0))}

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The pixel rows and sizes of the pictures ``images`` (``videos`` selects nothing: no video input)."""
        return pictures_with_sizes(inputs, images)

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's pictures: the pictures in order, as many as make up the row's placeholders (a picture's
        count from its size, :meth:`picture_tokens`)."""
        rows = ((inputs["input_ids"] == self.config.image_token_id) & keep).sum(-1).tolist()  # [B]
        sizes = inputs.get("image_sizes")
        return [
            (n, 0) for n in pictures_per_row(rows, self.picture_tokens(sizes) if sizes is not None else [])
        ]

    def media_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The prompt's pictures' own crops, one row each (``[crops, C, H, W]``, without the padding to the most
        crops of a picture) and their sizes: a later turn's picture adds rows after them."""
        pixels = inputs.get("pixel_values")
        if pixels is None or pixels.dim() != 5:  # none, or crops given flat already
            return super().media_rows(inputs)
        vision, sizes = self.config.vision_config, inputs["image_sizes"]
        crops = [
            image_size_to_num_patches(s, self.config.image_grid_pinpoints, vision.image_size)
            for s in sizes.tolist()
        ]
        own = torch.cat([picture[:n] for picture, n in zip(pixels, crops, strict=True)])
        return {"pixel_values": own, "image_sizes": sizes}

    def picture_tokens(self, image_sizes: torch.Tensor) -> list[int]:
        """Placeholders of each picture of ``image_sizes`` ``[n, 2]``: the model's own packing
        (``pack_image_features``: the base crop, the grid's crops unpadded to the picture's aspect, a newline after
        each row) run on features one value wide."""
        vision, pinpoints = self.config.vision_config, self.config.image_grid_pinpoints
        crops = [
            image_size_to_num_patches(size, pinpoints, vision.image_size) for size in image_sizes.tolist()
        ]
        features = [torch.zeros(n, _crop_tokens(self.config), 1) for n in crops]  # [crops, tokens, 1] each
        packed, _ = self.model.model.pack_image_features(
            features,
            image_sizes.cpu(),
            self.config.vision_feature_select_strategy,
            image_newline=torch.zeros(1),
        )
        return [picture.shape[0] for picture in packed]


class LlavaNextVideoAdapter(LlavaNextAdapter):
    """LLaVA-NeXT-Video (``llava-hf/LLaVA-NeXT-Video-7B-hf``; a LLaMA language model drafting, see
    :mod:`vlmspec.models.text`, or a smaller checkpoint of its tokenizer): LLaVA-NeXT's pictures, plus videos. A
    video's frames go through the same tower, each frame's patch grid average-pooled ``spatial_pool_stride`` x
    ``spatial_pool_stride`` (``vision_resampler``) and projected: ``pixel_values_videos`` ``[videos, frames, C, H,
    W]``, one ``<video>`` placeholder per pooled patch. A prompt's media items are its pictures and its videos.
    """

    model_types = ("llava_next_video",)
    layout_fields = (*LlavaNextAdapter.layout_fields, "spatial_pool_mode", "spatial_pool_stride")

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        found = super().visual_features(inputs)
        if inputs.get("pixel_values_videos") is not None:
            out = self.model.model.get_video_features(inputs["pixel_values_videos"], return_dict=True)
            found["video"] = VisualFeatures(embeds=out.pooler_output.flatten(0, 1))  # [videos * tokens, D]
        return found

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The pictures ``images`` (pixel rows and sizes) and the videos ``videos`` (one row each)."""
        found = super().media_items(inputs, images, videos)
        frames = inputs.get("pixel_values_videos")
        if frames is not None and range(frames.shape[0])[videos]:
            found["pixel_values_videos"] = frames[videos]
        return found

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's pictures (LLaVA-NeXT's) and videos (a batch's videos share their frame count and size)."""
        pictures = [images for images, _ in super().media_counts(inputs, keep)]
        return list(zip(pictures, _video_counts(inputs, keep, self.config.video_token_id), strict=True))

    def media_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """LLaVA-NeXT's picture rows, then one row per video."""
        rows = super().media_rows(inputs)
        if inputs.get("pixel_values_videos") is not None:
            rows["pixel_values_videos"] = inputs["pixel_values_videos"]
        return rows


def _video_counts(inputs: dict[str, Any], keep: torch.Tensor, video_id: int) -> list[int]:
    """Videos of each of the ``B`` rows: the videos of a batch share their frame count and size
    (``pixel_values_videos`` ``[N, F, C, H, W]``), so each has as many placeholders as any other."""
    return equal_items_per_row((inputs["input_ids"] == video_id) & keep, inputs.get("pixel_values_videos"))


def _crop_tokens(config: Any) -> int:
    """Visual tokens of one crop: one per patch, plus the CLS token under the ``"full"`` strategy."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


def _check_tower(config: Any) -> None:
    """Refuse a LLaVA model whose tower reads each picture at its own size (Pixtral): it has another layout."""
    tower = config.vision_config.model_type
    if tower not in _PATCH_GRID_TOWERS:
        raise InvalidInputError(
            f"a LLaVA model with a {tower!r} vision tower reads each picture at its own size, which vlmspec does "
            f"not support; it takes LLaVA checkpoints whose tower is a {' or '.join(_PATCH_GRID_TOWERS)} "
            "(LLaVA-1.5, LLaVA-NeXT)"
        )
