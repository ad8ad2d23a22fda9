"""Perception LM (``facebook/Perception-LM-1B`` drafting for ``-3B`` or ``-8B``): a Perception Encoder tower (timm's
``vit_pe_core``) whose patch features, CLS token dropped, go through a two-layer projector and a 2-D average pool,
in front of a Llama 3 language model with 1-D RoPE.

The processor cuts a picture into tiles of the tower's input size (a thumbnail of the whole first, then the grid of
tiles that fits it best, at most ``max_num_tiles``) and writes it as one ``<|image|>`` per visual token of every tile;
``pixel_values`` is ``[pictures, tiles, C, H, W]``: the pictures of one call share their tile count (the processor
stacks them), so a picture's token count is the same for all of them. A video's frames are read the same way, one
tile each: ``pixel_values_videos`` ``[videos, frames, C, H, W]``, one ``<|video|>`` per token. A prompt's media items
are its pictures and its videos. Pruned/scored prefills take the features from the model's own
``get_image_features``. Positions are the original 1-D prompt indices.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import VLMAdapter
from .data import VisualFeatures
from .media import equal_items_per_row


class PerceptionLMAdapter(VLMAdapter):
    model_types = ("perception_lm",)
    layout_fields = (  # tiles of img_size pixels (the tower's input), its patches pooled projector_pooling_ratio
        "vision_config.model_args.img_size",
        "vision_config.model_args.patch_size",
        "projector_pooling_ratio",
        "vision_use_cls_token",
    )
    fixed_processor_settings = frozenset({"tile_size", "size"})  # the tower's input

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        core, found = self.model.model, {}
        for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            if inputs.get(key) is not None:
                out = core.get_image_features(inputs[key], return_dict=True)
                found[kind] = VisualFeatures(
                    embeds=out.pooler_output.flatten(0, 1)
                )  # [items*tiles*tokens, D]
        return found

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """One pixel row per picture (its tiles) and per video (its frames)."""
        found = {}
        for key, items in (("pixel_values", images), ("pixel_values_videos", videos)):
            pixels = inputs.get(key)
            if pixels is not None and range(pixels.shape[0])[items]:
                found[key] = pixels[items]
        return found

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's pictures and videos: the items of a call share their tile (frame) count, so each has as many
        placeholders as any other of its kind."""
        ids = inputs["input_ids"]
        counts = [
            equal_items_per_row((ids == token) & keep, inputs.get(key))
            for token, key in zip(
                self.visual_token_ids(), ("pixel_values", "pixel_values_videos"), strict=True
            )
        ]
        return list(zip(*counts, strict=True))
