"""InternVL (InternVL3 and InternVL3.5 ``-hf`` checkpoints): an InternViT tower, a pixel shuffle and a projector in
front of a Qwen2 (or Qwen3) language model with 1-D RoPE.

The processor cuts a picture into tiles (plus a thumbnail of the whole when there are several) and writes it as
``<img>`` + ``image_seq_length`` ``<IMG_CONTEXT>`` tokens per tile + ``</img>``; a video becomes its frames, one
tile each, written ``Frame1: <img>...</img>`` and so on. The model reads every tile as a row of ``pixel_values``
``[tiles, C, H, W]``, pictures' and videos' alike, in the order of the prompt: it has one placeholder and one
kind of visual input. So does vlmspec: a prompt's media items are its ``<img>`` blocks (a picture, or one frame of
a video), counted as images, which is how the model sees them; a video's frames are pruned with the image ratio.
(Telling them apart would need the prompt's text; the model itself does not.)

Pruned/scored prefills (see :mod:`vlmspec.models.base`) take the visual features from the model's own
``get_image_features`` (the config's vision-feature layer and strategy apply, as in ``forward``). Positions are
the original 1-D prompt indices.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInputError
from .base import VisualFeatures, VLMAdapter
from .data import PromptLayout


class InternVLAdapter(VLMAdapter):
    model_types = ("internvl",)
    layout_fields = (  # tiles of image_size pixels, patch_size patches each, shuffled into image_seq_length tokens
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "downsample_ratio",
        "image_seq_length",
        "vision_feature_select_strategy",
    )

    def visual_token_ids(self) -> tuple[int, int]:
        """The one placeholder, ``<IMG_CONTEXT>``, for pictures and video frames alike."""
        return self.config.image_token_id, self.config.image_token_id

    def prompt_layout(self, inputs: dict[str, torch.Tensor]) -> PromptLayout:
        visual = inputs["input_ids"][0] == self.config.image_token_id
        return PromptLayout(visual=visual, is_video=torch.zeros_like(visual))

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        out = self.model.model.get_image_features(inputs["pixel_values"], return_dict=True)
        return {"image": VisualFeatures(embeds=out.pooler_output.flatten(0, 1))}  # [tiles * tokens, D]

    def placeholder_mask(
        self, ids: torch.Tensor, embeds: torch.Tensor, modality: str, values: torch.Tensor
    ) -> torch.Tensor:
        return self.model.model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=values)

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The tiles of the ``<img>`` blocks ``images`` (``videos`` selects nothing: a video is its frames' blocks)."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return {}
        ids = inputs["input_ids"]
        tiles = [n for row in range(ids.shape[0]) for n in self._block_tiles(ids[row])]
        if sum(tiles) != pixels.shape[0]:
            raise InvalidInputError(
                f"the prompts' <img> blocks hold {sum(tiles)} tiles of {self.config.image_seq_length} placeholders "
                f"but pixel_values has {pixels.shape[0]}; build the inputs with the model's processor"
            )
        starts = [0, *torch.tensor(tiles, dtype=torch.long).cumsum(0).tolist()]
        first, last = range(len(tiles))[images].start, range(len(tiles))[images].stop
        if first >= last:
            return {}
        return {"pixel_values": pixels[starts[first] : starts[last]]}

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's ``<img>`` blocks (pictures and video frames), as images."""
        ids = inputs["input_ids"]
        return [(len(self._block_tiles(ids[row][keep[row]])), 0) for row in range(ids.shape[0])]

    def _block_tiles(self, ids: torch.Tensor) -> list[int]:
        """Tiles of each ``<img>`` block of one row of ``[L]`` ids: its runs of placeholders, in order."""
        visual = (ids == self.config.image_token_id).long()  # [L]
        edges = torch.diff(
            visual, prepend=visual.new_zeros(1), append=visual.new_zeros(1)
        )  # +1 start, -1 end
        lengths = edges.eq(-1).nonzero().flatten() - edges.eq(1).nonzero().flatten()  # [blocks]
        return (lengths // self.config.image_seq_length).tolist()
