"""MiniCPM-V 4.6 (``openbmb/MiniCPM-V-4.6``) and 4.7 (``openbmb/MiniCPM-V-4.7-1B``): a NaViT tower (patches of any
picture's own grid, a window-attention merger part-way up, a 2 x 2 merger after it) in front of Qwen3.5's hybrid
language model (Gated DeltaNet and attention layers: :mod:`.hybrid`,
:class:`~vlmspec.models.qwen3_5.GatedDeltaDecoder`) with 1-D positions.

The processor reads a picture as its whole, resized near ``scale_resolution`` pixels a side, and (when larger) the
grid of slices that fits it best; a video as its frames. Each of those is an item: ``target_sizes`` (or
``target_sizes_videos``) holds its patch grid ``[h, w]`` and it becomes ``h * w / 16`` tokens (``downsample_mode``
``16x``; ``4x`` keeps four times as many), written between ``<image>`` or ``<slice>`` tags. ``pixel_values``
``[1, C, P, sum(h * w * P)]`` packs every item's patches side by side along its last axis (NaViT-packed), a batch's
prompts' too. So vlmspec reads a prompt's media items as those items, in order (its pictures' and slices' as
images, its videos' frames as videos), cutting the packed pixels at each item's columns.

MiniCPM-V 4.7 is 4.6 with Canvas M-RoPE: each item's tokens laid out on a canvas of its grid (its ``get_rope_index``,
from the ids, ``mm_token_type_ids`` and the grids), decoded tokens after the prompt's largest position as Qwen's
(:class:`~vlmspec.models.qwen.QwenVLAdapter`'s positions).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInputError
from .data import VisualFeatures
from .media import pictures_per_row
from .qwen import QwenVLAdapter
from .qwen3_5 import GatedDeltaDecoder

_KINDS = {  # modality: its pixels, its items' patch grids
    "image": ("pixel_values", "target_sizes"),
    "video": ("pixel_values_videos", "target_sizes_videos"),
}


class MiniCPMV4_6Adapter(GatedDeltaDecoder):
    model_types = ("minicpmv4_6",)
    layout_fields = (
        "vision_config.patch_size",
        "vision_config.window_kernel_size",
        "merge_kernel_size",
        "downsample_mode",
    )
    fixed_processor_settings = frozenset({"patch_size", "downsample_mode"})  # the model's merges fix them

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def _tokens_per_item(self, inputs: dict[str, Any], modality: str) -> list[int]:
        """Each item's tokens: its patch grid, merged 2 x 2 twice (``downsample_mode`` ``16x``) or once (``4x``,
        the model's window merger skipped), as the model's ``get_image_features`` merges it."""
        grids = inputs.get(_KINDS[modality][1])
        patches_per_token = 4 if self.config.downsample_mode == "4x" else 16
        return [] if grids is None else (grids.prod(-1) // patches_per_token).tolist()

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        inner, found = self.model.model, {}
        if inputs.get("pixel_values") is not None:
            out = inner.get_image_features(inputs["pixel_values"], inputs["target_sizes"])
            found["image"] = VisualFeatures(embeds=torch.cat(out.pooler_output))  # [tokens, D]
        if inputs.get("pixel_values_videos") is not None:
            out = inner.get_video_features(inputs["pixel_values_videos"], inputs["target_sizes_videos"])
            found["video"] = VisualFeatures(embeds=torch.cat(out.pooler_output))
        return found

    def placeholder_mask(
        self, inputs: dict[str, torch.Tensor], embeds: torch.Tensor, modality: str, values: torch.Tensor
    ) -> torch.Tensor:
        """``[1, L, 1]``: the placeholders of ``modality``, which must be as many as its ``[n, D]`` features."""
        mask = inputs["input_ids"] == self.visual_token_ids()[modality == "video"]
        if int(mask.sum()) != values.shape[0]:
            raise InvalidInputError(
                f"the prompt holds {int(mask.sum())} {modality} placeholders but its {modality}s make "
                f"{values.shape[0]} visual tokens; build the inputs with the model's processor"
            )
        return mask[..., None]

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The items ``images`` (pictures and their slices) and ``videos`` (frames): their grids, and their packed
        pixels' columns."""
        found: dict[str, Any] = {}
        for (pixels, grid), items in zip(_KINDS.values(), (images, videos), strict=True):
            if inputs.get(grid) is None or not range(inputs[grid].shape[0])[items]:
                continue
            columns = inputs[grid].prod(-1) * inputs[pixels].shape[2]  # [items] each item's packed columns
            starts = [0, *columns.cumsum(0).tolist()]
            chosen = range(inputs[grid].shape[0])[items]
            found[pixels] = inputs[pixels][..., starts[chosen.start] : starts[chosen.stop]]
            found[grid] = inputs[grid][items]
        return found

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's items: the items in order, as many as make up the row's placeholders."""
        ids, (image_id, video_id) = inputs["input_ids"], self.visual_token_ids()
        images = pictures_per_row(
            ((ids == image_id) & keep).sum(-1).tolist(), self._tokens_per_item(inputs, "image")
        )
        frames = pictures_per_row(
            ((ids == video_id) & keep).sum(-1).tolist(), self._tokens_per_item(inputs, "video")
        )
        return list(zip(images, frames, strict=True))

    def media_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The items' grids and their packed pixels, a patch column per row (``[columns, C, P]``): a later turn's
        picture adds rows after them."""
        rows = {}
        for pixels, grid in _KINDS.values():
            if inputs.get(pixels) is not None:
                rows[pixels], rows[grid] = inputs[pixels][0].permute(2, 0, 1), inputs[grid]
        return rows


class MiniCPMV4_7Adapter(MiniCPMV4_6Adapter, QwenVLAdapter):
    model_types = ("minicpmv4_7",)
    rope_inputs = ("target_sizes", "target_sizes_videos", "attention_mask")
