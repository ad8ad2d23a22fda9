"""Aya Vision (``CohereLabs/aya-vision-8b`` drafting for ``-32b``): a SigLIP tower, a pixel shuffle and a SwiGLU
projector in front of a Cohere language model (8B: Command R7B's Cohere2, three sliding-window layers per global
one; 32B: Aya Expanse's Cohere, every layer global).

Pictures only. The processor cuts a picture into tiles of the tower's input size (plus a thumbnail of the whole when
there are several) and writes it as ``<|START_OF_IMG|>``, each tile's ``TILE_i`` + one ``<|IMG_PATCH|>`` per visual
token, ``TILE_GLOBAL`` + the thumbnail's, ``<|END_OF_IMG|>``; the model reads every tile as a row of
``pixel_values`` ``[tiles, C, H, W]``. A prompt's media items are its tiles (:class:`~.blocks.PlaceholderBlocks`),
as InternVL's. Positions are the original 1-D prompt indices; the sliding-window layers see the tree through
:func:`~.gemma3.layer_masks`, as Gemma 3's local layers do.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .blocks import PlaceholderBlocks
from .gemma3 import layer_masks


class AyaVisionAdapter(PlaceholderBlocks):
    model_types = ("aya_vision",)
    layout_fields = (  # tiles of image_size pixels, patch_size patches each, shuffled downsample_factor per side
        "vision_config.model_type",
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "downsample_factor",
        "vision_feature_select_strategy",
    )
    fixed_processor_settings = frozenset({"size", "crop_size", "do_resize", "do_center_crop"})  # the tile
    placeholder, block = "<|IMG_PATCH|>", "tile"
    write_hint = "write each picture in the prompt as one <image> and let the processor expand it"

    @functools.cached_property
    def block_tokens(self) -> int:
        """Placeholders per tile: the tower's patches, shuffled ``downsample_factor`` per side (a 364-pixel tile of
        14-pixel patches: 676 patches, 169 tokens)."""
        vision = self.config.vision_config
        side = vision.image_size // (vision.patch_size * self.config.downsample_factor)
        return side * side

    def _logits(
        self, cache: Any, rows: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """The tree mask for the global layers; for the sliding-window ones (Cohere2's), the same with the keys
        outside the window hidden."""
        return super()._logits(cache, rows, position_ids, layer_masks(bias, position_ids, self.config))
