"""Ovis2 (``Ovis2-1B`` drafting for ``Ovis2-8B`` and up; transformers' ``ovis2`` conversions): a ViT tower whose
patch features, strided 2 x 2 into one, are read as a probability distribution over a visual vocabulary; each visual
token is the expected row of the visual embedding table, in front of a Qwen2.5 language model (the same tokenizer at
every size).

Pictures only. The processor writes a picture as ``<IMG_START>``, the whole picture's ``<IMG_ATOM>`` placeholders,
``<IMG_GRID>``, then (when it is cut into several tiles) each tile's, ``<IMG_COL>`` between the tiles of a row and
``<IMG_ROW>`` between rows, and ``<IMG_END>``; the model reads every tile, the whole picture first, as a row of
``pixel_values`` ``[tiles, C, H, W]``. A prompt's media items are its tiles (:class:`~.blocks.PlaceholderBlocks`), as
InternVL's and Aya Vision's. Where a prompt has pictures, the model embeds the five indicator tokens with the last
rows of the visual embedding table, not the text embeddings (:meth:`Ovis2Adapter.embed_prompt` does the same); the
draft keeps them when it drops visual tokens, since they are the picture's frame, not its content.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .blocks import PlaceholderBlocks


class Ovis2Adapter(PlaceholderBlocks):
    model_types = ("ovis2",)
    layout_fields = (  # tiles of image_size pixels, patch_size patches each, strided hidden_stride per side
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "vision_config.hidden_stride",
    )
    fixed_processor_settings = frozenset({"size", "do_resize"})  # the tile (its token count: every family's)
    placeholder, block = "<IMG_ATOM>", "tile"
    write_hint = "write each picture in the prompt as one <image> and let the processor expand it"

    @functools.cached_property
    def block_tokens(self) -> int:
        """Placeholders per tile: the tower's patches per side, padded to a multiple of ``hidden_stride`` and
        strided (a 448-pixel tile of 14-pixel patches: 32 per side, 256 tokens)."""
        vision = self.config.vision_config
        side = -(-(vision.image_size // vision.patch_size) // vision.hidden_stride)
        return side * side

    def embed_prompt(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The placeholders replaced by their visual tokens, and where the prompt has pictures, the indicator
        tokens by their rows of the visual embedding table, as the model's own forward does."""
        prompt = super().embed_prompt(inputs)
        if inputs.get("pixel_values") is None:
            return prompt
        vision = self.config.vision_config
        table = self.model.model.visual_embeddings_table
        rows = torch.arange(vision.vocab_size - vision.num_visual_indicator_tokens, vision.vocab_size)
        indicators = table(rows.to(table.weight.device))  # [5, D]
        ids = inputs["input_ids"][..., None]  # [1, L, 1]
        embeds = prompt["inputs_embeds"]  # [1, L, D]
        for token, row in zip(self.config.visual_indicator_token_ids, indicators, strict=True):
            embeds = torch.where(ids == token, row.to(embeds.dtype), embeds)
        return {**prompt, "inputs_embeds": embeds}
