"""SmolVLM2 (``SmolVLM2-256M-Video-Instruct`` drafting for ``-500M-Video-Instruct``: the same SigLIP tiles of 512
pixels, 64 tokens each, and the same tokenizer): a SigLIP tower whose patch features are pixel-shuffled
(``scale_factor`` x ``scale_factor`` into one) and projected, in front of a SmolLM2 (Llama) language model with 1-D
RoPE.

The processor resizes a picture to at most a grid of tiles and cuts it into them, plus the whole picture shrunk to
one tile, writing each tile as ``<fake_token_around_image><row_r_col_c>`` + ``image_seq_len`` ``<image>`` tokens;
a video becomes its frames, each one tile after a line with its time. The model reads every tile as a row of
``pixel_values`` ``[prompts, tiles, C, H, W]``, pictures' and frames' alike, in the order of the prompt; a batch of
prompts pads each prompt's tiles with all-zero ones, which the model drops (``get_image_features``: "padding images
are full 0"). So vlmspec reads it as InternVL's tiles (:mod:`vlmspec.models.blocks`): a prompt's media items are its
real tiles, in order, counted as images (a video's frames are pruned with the image ratio), found by the model's own
rule.

Idefics3 (SmolVLM 1, Idefics3-8B) is the same architecture without videos: :class:`Idefics3Adapter`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..errors import InvalidInputError
from .blocks import Tiles
from .data import VisualFeatures


class SmolVLMAdapter(Tiles):
    model_types = ("smolvlm",)
    layout_fields = (*Tiles.tile_fields, "scale_factor")
    fixed_processor_settings = frozenset({"max_image_size"})  # the tile: the tower's input
    placeholder = "<image>"
    pictures_apart_from_videos = (  # transformers' SmolVLMProcessor (5.x) returns the video's rows in their place
        "SmolVLM2's processor returns a prompt's pictures and its videos' frames under one name, pixel_values, so the "
        "frames' replace the pictures'"
    )

    @functools.cached_property
    def block_tokens(self) -> int:
        """Placeholders per tile, as the model makes them: the tower's patches, ``scale_factor`` x ``scale_factor``
        shuffled into one (a 512-pixel tile of 16-pixel patches, shuffled 4 x 4: 64 tokens)."""
        vision = self.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // self.config.scale_factor**2

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        out = self.model.model.get_image_features(
            inputs["pixel_values"], inputs.get("pixel_attention_mask"), return_dict=True
        )
        return {"image": VisualFeatures(embeds=torch.cat(out.pooler_output))}  # [real tiles * tokens, D]

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The tiles ``images`` of the inputs' real tiles in order, as one prompt's ``[1, n, C, H, W]`` (``videos``
        selects nothing: frames are tiles too)."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return {}
        real = _real_tiles(pixels)  # [prompts * tiles] bool
        blocks = self._blocks(inputs["input_ids"])
        if blocks != int(real.sum()):
            raise InvalidInputError(
                f"the prompts' {self.placeholder} placeholders make {blocks} {self.block}s of {self.block_tokens} "
                f"but pixel_values holds {int(real.sum())}; build the inputs with the model's processor"
            )
        if not range(blocks)[images]:
            return {}
        found = {"pixel_values": pixels.flatten(0, 1)[real][images][None]}
        if inputs.get("pixel_attention_mask") is not None:
            found["pixel_attention_mask"] = inputs["pixel_attention_mask"].flatten(0, 1)[real][images][None]
        return found

    def media_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The prompt's real tiles, one row each (``[tiles, C, H, W]`` and their pixel masks): a later turn's
        picture adds tiles after them."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return {}
        real = _real_tiles(pixels)
        rows = {"pixel_values": pixels.flatten(0, 1)[real]}
        if inputs.get("pixel_attention_mask") is not None:
            rows["pixel_attention_mask"] = inputs["pixel_attention_mask"].flatten(0, 1)[real]
        return rows


class Idefics3Adapter(SmolVLMAdapter):
    """Idefics3 (``model_type`` ``idefics3``): SmolVLM (1) (``SmolVLM-256M-Instruct`` drafting for
    ``SmolVLM-500M-Instruct``, the same tiles and tokenizer), SmolVLM-Instruct and Idefics3-8B-Llama3. SmolVLM2's
    architecture, its processor and model the same tiles read the same way (SmolVLM2's classes are copies of these),
    without a video processor: a video reaches it as its frames' pictures
    (:func:`vlmspec.conversations.frames_as_pictures`)."""

    model_types = ("idefics3",)
    write_hint = "write each picture in the prompt as one <image> and let the processor expand it"
    frames_as_blocks = False
    pictures_apart_from_videos = ""  # a video is its frames' pictures

    def placeholder_mask(
        self, inputs: dict[str, torch.Tensor], embeds: torch.Tensor, modality: str, values: torch.Tensor
    ) -> torch.Tensor:
        """``[1, L, 1]`` bool: the ``<image>`` placeholders among the prompt's ids, found as the model's
        ``inputs_merger`` finds them (Idefics3's model has no ``get_placeholder_mask``), with the same check against
        the ``[n, D]`` features ``values``."""
        mask = (inputs["input_ids"] == self.config.image_token_id)[..., None]
        if int(mask.sum()) != values.shape[0]:
            raise InvalidInputError(
                f"the prompt holds {int(mask.sum())} {self.placeholder} placeholders for {values.shape[0]} visual "
                f"features; {self.write_hint}"
            )
        return mask


def _real_tiles(pixels: torch.Tensor) -> torch.Tensor:
    """Which tiles of ``pixels`` ``[prompts, tiles, C, H, W]`` are real, by the model's rule: a padding tile is all
    zeros. ``[prompts * tiles]`` bool, in the order of the prompts and their tiles."""
    return pixels.flatten(0, 1).flatten(1).ne(0).any(-1)
