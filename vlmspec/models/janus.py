"""Janus (``Janus-Pro-1B`` drafting for ``Janus-Pro-7B``; transformers' ``janus`` conversions) and DeepSeek-VL, the
model it grew from (``deepseek-vl-1.3b-chat`` drafting for ``deepseek-vl-7b-chat``; ``deepseek_vl``): a SigLIP tower
whose patch features go through a two-layer aligner, one token per patch, in front of a DeepSeek-LLM (Llama)
language model with the same tokenizer at both sizes. Janus's image-generation half (a VQ model and its head) is not
used to read pictures, and vlmspec generates text only.

Pictures only. The processor pads a picture to a square of the tower's input size and writes it as one
``<image_placeholder>`` per patch (Janus's framed by ``<begin_of_image>`` and ``<end_of_image>``); the model reads
each picture as a row of ``pixel_values`` ``[pictures, C, H, W]``. A prompt's media items are its pictures
(:class:`~.blocks.PlaceholderBlocks`), as LLaVA-1.5's.

DeepSeek-VL 7B (``deepseek_vl_hybrid``) reads each picture twice, SigLIP's 384 pixels and a SAM encoder's 1024
(``high_res_pixel_values``, a row per picture), its aligner joining both into the same 576 tokens: the same prompt
tokens as DeepSeek-VL 1.3B's, whose processor gives the 384-pixel rows alone. So the 1.3B model drafts for the 7B
(``vlmspec.loading.SERIES``), reading the target's low-resolution pixels; the other way round is refused.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..errors import InvalidInputError
from .blocks import PlaceholderBlocks
from .data import VisualFeatures


class JanusAdapter(PlaceholderBlocks):
    model_types = ("janus",)
    layout_fields = (  # pictures of image_size pixels, patch_size patches each, a token per patch
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
    )
    fixed_processor_settings = frozenset({"size", "do_resize"})  # the tower's input
    placeholder, block = "<image_placeholder>", "picture"
    write_hint = "write each picture in the prompt as one <image_placeholder> and let the processor expand it"

    @functools.cached_property
    def block_tokens(self) -> int:
        """Placeholders per picture: the tower's patches (a 384-pixel picture of 16-pixel patches: 576)."""
        vision = self.config.vision_config
        return (vision.image_size // vision.patch_size) ** 2


class DeepseekVLAdapter(JanusAdapter):
    """DeepSeek-VL: Janus's pictures and tokens without the frame around them (its processor writes the placeholders
    alone)."""

    model_types = ("deepseek_vl",)


class DeepseekVLHybridAdapter(DeepseekVLAdapter):
    """DeepSeek-VL's hybrid tower: each picture's ``pixel_values`` row and its ``high_res_pixel_values`` row."""

    model_types = ("deepseek_vl_hybrid",)
    layout_fields = (*JanusAdapter.layout_fields, "high_res_vision_config.image_size")
    fixed_processor_settings = JanusAdapter.fixed_processor_settings | {
        "high_res_size"
    }  # the SAM encoder's input

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        high = inputs.get("high_res_pixel_values")
        if high is None:
            raise InvalidInputError(
                "DeepSeek-VL's hybrid tower reads each picture at two resolutions, but the inputs hold no "
                "high_res_pixel_values; build them with its processor (a deepseek_vl_hybrid model drafts only for "
                "another of its type)"
            )
        out = self.model.model.get_image_features(inputs["pixel_values"], high, return_dict=True)
        return {"image": VisualFeatures(embeds=out.pooler_output.flatten(0, 1))}  # [pictures * tokens, D]

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The pictures ``images``' rows at both resolutions."""
        items = super().media_items(inputs, images, videos)
        if items and inputs.get("high_res_pixel_values") is not None:
            items["high_res_pixel_values"] = inputs["high_res_pixel_values"][images]
        return items
