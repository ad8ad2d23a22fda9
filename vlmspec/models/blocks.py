"""Families whose prompts hold one kind of visual placeholder, in blocks of a fixed size, one row of
``pixel_values`` ``[blocks, C, H, W]`` per block: InternVL's tiles, Gemma 3's and LLaVA-1.5's pictures (SmolVLM2's
tiles too, its ``pixel_values`` ``[prompts, tiles, C, H, W]`` padded with all-zero tiles: :mod:`.smolvlm`).

A prompt's media items are then its blocks, counted as images, in the order of the prompt: a block goes through the
vision tower on its own, so a prompt's later items are its later blocks, and a batch's rows split by their
placeholders alone.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..errors import InvalidInputError
from .base import NO_VIDEO_TOKEN, VLMAdapter
from .data import PromptLayout, VisualFeatures


class PlaceholderBlocks(VLMAdapter):
    """Subclasses set :attr:`placeholder` and :attr:`block` (how errors name them) and :attr:`block_tokens`."""

    placeholder: ClassVar[str] = ""
    """The placeholder token's text, e.g. ``<IMG_CONTEXT>``."""
    block: ClassVar[str] = ""
    """What a block is to the model, e.g. ``tile``."""
    write_hint: ClassVar[str] = "build them with the model's processor"
    """How to write the placeholders right, for the error a wrong count gets."""
    frames_as_blocks: ClassVar[bool] = False
    """The processor writes a video as its frames, each block(s) of the one placeholder (InternVL, SmolVLM2); else
    the model takes no video (Gemma 3, LLaVA-1.5)."""

    def visual_token_ids(self) -> tuple[int, int]:
        """The one placeholder for pictures, and for video frames where :attr:`frames_as_blocks` (else no token is a
        video's)."""
        return (
            self.config.image_token_id,
            self.config.image_token_id if self.frames_as_blocks else NO_VIDEO_TOKEN,
        )

    @property
    def block_tokens(self) -> int:
        """Placeholders per block."""
        raise NotImplementedError

    def prompt_layout(self, inputs: dict[str, torch.Tensor]) -> PromptLayout:
        visual = inputs["input_ids"][0] == self.config.image_token_id
        return PromptLayout(visual=visual, is_video=torch.zeros_like(visual))

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        out = self.model.model.get_image_features(inputs["pixel_values"], return_dict=True)
        return {"image": VisualFeatures(embeds=out.pooler_output.flatten(0, 1))}  # [blocks * tokens, D]

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The rows of the blocks ``images`` (``videos`` selects nothing: the model has no other kind)."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return {}
        blocks = self._blocks(inputs["input_ids"])  # every row's: one count, one read on the host
        if blocks != pixels.shape[0]:
            raise InvalidInputError(
                f"the prompts' {self.placeholder} placeholders make {blocks} {self.block}s of {self.block_tokens} "
                f"but pixel_values holds {pixels.shape[0]}; build the inputs with the model's processor"
            )
        return {"pixel_values": pixels[images]} if range(blocks)[images] else {}

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's blocks, as images."""
        ids = inputs["input_ids"]
        return [(self._blocks(ids[row][keep[row]]), 0) for row in range(ids.shape[0])]

    def _blocks(self, ids: torch.Tensor) -> int:
        """Blocks of the prompt ids ``ids`` (one row ``[L]`` or several), :attr:`block_tokens` placeholders each."""
        placeholders = int((ids == self.config.image_token_id).sum())
        if placeholders % self.block_tokens:
            raise InvalidInputError(
                f"a prompt holds {placeholders} {self.placeholder} placeholders, not a whole number of {self.block}s "
                f"of {self.block_tokens}; {self.write_hint}"
            )
        return placeholders // self.block_tokens


class Tiles(PlaceholderBlocks):
    """Families that cut pictures into tiles and write a video as its frames, each a tile of the same one placeholder
    (InternVL, SmolVLM2): a prompt's media items are its tiles, pictures' and frames' alike."""

    tile_fields: ClassVar[tuple[str, ...]] = (
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
    )
    """The tile's geometry: tiles of ``image_size`` pixels, ``patch_size`` patches each (a subclass's
    :attr:`layout_fields` add how the patches shuffle into fewer tokens)."""
    block = "tile"
    write_hint = "write pictures and videos in the prompt as the model's processor does"
    frames_as_blocks = True
