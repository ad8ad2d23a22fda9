"""InternVL (InternVL3 and InternVL3.5 ``-hf`` checkpoints): an InternViT tower, a pixel shuffle and a projector in
front of a Qwen2 (or Qwen3) language model with 1-D RoPE.

The processor cuts a picture into tiles (plus a thumbnail of the whole when there are several) and writes it as
``<img>`` + ``image_seq_length`` ``<IMG_CONTEXT>`` tokens per tile + ``</img>``; a video becomes its frames, one
tile each, written ``Frame1: <img>...</img>`` and so on. The model reads every tile as a row of ``pixel_values``
``[tiles, C, H, W]``, pictures' and videos' alike, in the order of the prompt: it has one placeholder and one
kind of visual input. So does vlmspec: a prompt's media items are its tiles, counted as images, which is how the
model sees them (each tile goes through the tower on its own); a video's frames are pruned with the image ratio.
(Telling them apart would need the prompt's text; the model itself does not.) Counting tiles, not pictures, lets
a prompt reuse the cache of one whose picture was its own picture's first tile (:mod:`vlmspec.prefix_cache`):
the prefix they share ends after that tile, and the rest of the picture's tiles are sent to the tower.

Pruned/scored prefills (see :mod:`vlmspec.models.base`) take the visual features from the model's own
``get_image_features`` (the config's vision-feature layer and strategy apply, as in ``forward``). Positions are
the original 1-D prompt indices.
"""

from __future__ import annotations

import functools

from .blocks import Tiles


class InternVLAdapter(Tiles):
    model_types = ("internvl",)
    layout_fields = (*Tiles.tile_fields, "downsample_ratio", "vision_feature_select_strategy")
    fixed_processor_settings = frozenset({"size", "crop_size", "do_resize", "do_center_crop"})  # the tile
    placeholder = "<IMG_CONTEXT>"

    @functools.cached_property
    def block_tokens(self) -> int:
        """Placeholders per tile, as the model makes them: the tower's patches, shuffled ``downsample_ratio`` per
        side (a 448-pixel tile of 14-pixel patches: 1024 patches, 256 tokens)."""
        vision = self.config.vision_config
        side, patch = (_pair(getattr(vision, name)) for name in ("image_size", "patch_size"))
        patches = (side[0] // patch[0]) * (side[1] // patch[1])
        return round(patches * self.config.downsample_ratio**2)


def _pair(value: int | list[int] | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (value[0], value[1])
