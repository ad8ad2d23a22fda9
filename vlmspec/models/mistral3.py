"""Mistral 3 (``model_type`` ``mistral3``: ``Ministral-3-3B-Instruct-2512`` drafting for ``Ministral-3-14B-`` or
``-8B-Instruct-2512``; Mistral-Small-3.1/3.2-24B): a Pixtral tower that reads each picture at its own size, its
patches merged ``spatial_merge_size`` x ``spatial_merge_size`` into one token and projected, in front of a Mistral
(or Ministral 3) language model with 1-D RoPE.

The processor resizes a picture so that its sides are whole numbers of merged patches (at most ``longest_edge``) and
writes it as rows of ``[IMG]`` tokens, one per merged patch, each row ended by ``[IMG_BREAK]`` and the last by
``[IMG_END]``: a picture's token count follows its size. ``pixel_values`` ``[pictures, C, H, W]`` holds the pictures
padded to the largest, with ``image_sizes`` ``[pictures, 2]``; the tower crops each back to its size and attends
within each picture only, so a prompt's media items are its pictures, read one by one or together alike.

Pictures only (a video reaches it as its frames' pictures: :func:`vlmspec.conversations.frames_as_pictures`).
Pruned/scored prefills take the features from the model's own ``get_image_features`` (the config's feature layer).
Positions are the original 1-D prompt indices.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import NO_VIDEO_TOKEN, VLMAdapter
from .data import VisualFeatures
from .media import pictures_per_row, pictures_with_sizes


class Mistral3Adapter(VLMAdapter):
    model_types = ("mistral3",)
    layout_fields = (  # pictures cut into patch_size patches, merged spatial_merge_size x spatial_merge_size
        "vision_config.model_type",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "spatial_merge_size",
    )
    fixed_processor_settings = frozenset({"patch_size"})  # the merged patch: a picture's sides are whole ones

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, NO_VIDEO_TOKEN

    @property
    def merged_patch(self) -> int:
        """Pixels per side of the square one token reads: a patch, merged ``spatial_merge_size`` times."""
        return self.config.vision_config.patch_size * self.config.spatial_merge_size

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        out = self.model.model.get_image_features(
            inputs["pixel_values"], inputs["image_sizes"], return_dict=True
        )
        return {"image": VisualFeatures(embeds=torch.cat(out.pooler_output))}  # [pictures * tokens, D]

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The pixel rows and sizes of the pictures ``images`` (``videos`` selects nothing: no video input)."""
        return pictures_with_sizes(inputs, images)

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's pictures: the pictures in order, as many as make up the row's ``[IMG]`` placeholders (a
        picture's count from its size)."""
        rows = ((inputs["input_ids"] == self.config.image_token_id) & keep).sum(-1).tolist()  # [B]
        sizes = inputs.get("image_sizes")
        tokens = (sizes // self.merged_patch).prod(-1).tolist() if sizes is not None else []
        return [(n, 0) for n in pictures_per_row(rows, tokens)]

    def media_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The prompt's pictures without the padding to the largest: each picture's own pixels as merged patches,
        one row each (``[patches, C * m * m]``, ``m`` :attr:`merged_patch`), and the sizes; a later turn's picture
        adds rows after them."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return {}
        m, sizes = self.merged_patch, inputs["image_sizes"]
        patches = [
            torch.nn.functional.unfold(picture[None, :, :h, :w], kernel_size=m, stride=m)[0].T
            for picture, (h, w) in zip(pixels, sizes.tolist(), strict=True)
        ]  # [patches, C * m * m] each
        return {"pixel_values": torch.cat(patches), "image_sizes": sizes}
