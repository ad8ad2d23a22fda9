"""VideoLLaMA3 (``VideoLLaMA3-2B`` drafting for ``VideoLLaMA3-7B``; transformers' ``video_llama_3`` conversions): a
tower that reads each picture at its own size, Qwen2-VL's way (``pixel_values`` ``[patches, D]`` of every item one
after the other, an item's ``t * h * w`` patches in its ``*_grid_thw`` row), in front of a Qwen2.5 language model
with the same tokenizer at both sizes and plain 1-D rotary positions.

* A picture: one ``<|image_pad|>`` per patch (``image_merge_sizes`` 1).
* A video: each frame's patches merged ``m x m`` (``video_merge_sizes``, 2), then the processor's token compression
  drops the frame tokens that repeat the previous frame's (``video_compression_mask`` ``[tokens]`` over every frame
  token of every video; the kept ones are the video's placeholders). Each frame is written ``Time t s:`` and its
  kept ``<|video_pad|>`` tokens, so a frame's tokens are a span of their own, which pruning keeps by frame.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import VLMAdapter
from .data import VisualFeatures
from .qwen import item_rows, take_items

_MODALITIES = (  # the processor outputs of each modality: pixel rows, their grid, their merge size
    ("image", "pixel_values", "image_grid_thw", "image_merge_sizes"),
    ("video", "pixel_values_videos", "video_grid_thw", "video_merge_sizes"),
)
_KEPT = "video_compression_mask"


class VideoLlama3Adapter(VLMAdapter):
    model_types = ("video_llama_3",)
    # pixel rows are C x patch x patch
    layout_fields = ("vision_config.patch_size", "vision_config.num_channels")
    fixed_processor_settings = frozenset({"do_resize"})  # pictures resized to whole (merged) patches

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        """The model's ``get_image_features`` / ``get_video_features`` (one row per merged token), a video's rows
        cut to those its compression mask keeps, as the model's ``forward`` does."""
        core, found = self.model.model, {}
        for modality, pixels, grid, merges in _MODALITIES:
            if inputs.get(pixels) is None:
                continue
            read = core.get_image_features if modality == "image" else core.get_video_features
            out = read(inputs[pixels], inputs[grid], inputs[merges], return_dict=True)
            embeds = torch.cat(out.pooler_output)  # [tokens, D]
            if modality == "video" and inputs.get(_KEPT) is not None:
                embeds = embeds[inputs[_KEPT].to(embeds.device)]
            found[modality] = VisualFeatures(embeds=embeds)
        return found

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """Each modality's pixel rows, grid rows and merge sizes of the items picked; the videos' part of the
        compression mask too."""
        found: dict[str, Any] = {}
        for (modality, pixels, grid, merges), items in zip(_MODALITIES, (images, videos), strict=True):
            rows = item_rows(inputs[grid].prod(-1), items) if inputs.get(grid) is not None else None
            if rows is None:
                continue
            found |= {pixels: inputs[pixels][rows], grid: inputs[grid][items], merges: inputs[merges][items]}
            if modality == "video" and inputs.get(_KEPT) is not None:
                found[_KEPT] = inputs[_KEPT][item_rows(_merged_tokens(inputs, grid, merges), items)]
        return found

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Item ``i`` has ``t * h * w / merge**2`` placeholders (a video: those its compression mask keeps); rows
        take the items in order until their placeholders are covered."""
        image_id, video_id = self.visual_token_ids()
        per_modality = []
        for (modality, _, grid, merges), token in zip(_MODALITIES, (image_id, video_id), strict=True):
            tokens: list[int] = []
            if inputs.get(grid) is not None:
                tokens = _merged_tokens(inputs, grid, merges).tolist()
                kept = inputs.get(_KEPT) if modality == "video" else None
                if kept is not None:  # each video's part of the mask: its kept tokens
                    tokens = [int(part.sum()) for part in kept.split(tokens)]
            wanted = ((inputs["input_ids"] == token) & keep).sum(-1).tolist()  # [B] placeholders per row
            per_modality.append(take_items(tokens, wanted, grid))
        return list(zip(*per_modality, strict=True))


def _merged_tokens(inputs: dict[str, Any], grid: str, merges: str) -> torch.Tensor:
    """``[items]``: each item's tokens after its patches are merged, before any compression."""
    return inputs[grid].prod(-1) // inputs[merges] ** 2
