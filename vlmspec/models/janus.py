"""Janus (``Janus-Pro-1B`` drafting for ``Janus-Pro-7B``; transformers' ``janus`` conversions) and DeepSeek-VL, the
model it grew from (``deepseek-vl-1.3b-chat`` drafting for ``deepseek-vl-7b-chat``; ``deepseek_vl``): a SigLIP tower
whose patch features go through a two-layer aligner, one token per patch, in front of a DeepSeek-LLM (Llama)
language model with the same tokenizer at both sizes. Janus's image-generation half (a VQ model and its head) is not
used to read pictures, and vlmspec generates text only.

Pictures only. The processor pads a picture to a square of the tower's input size and writes it as one
``<image_placeholder>`` per patch (Janus's framed by ``<begin_of_image>`` and ``<end_of_image>``); the model reads
each picture as a row of ``pixel_values`` ``[pictures, C, H, W]``. A prompt's media items are its pictures
(:class:`~.blocks.PlaceholderBlocks`), as LLaVA-1.5's. (DeepSeek-VL's hybrid tower, ``deepseek_vl_hybrid``: a SAM
encoder beside SigLIP at 1024 pixels, is another family.)
"""

from __future__ import annotations

import functools

from .blocks import PlaceholderBlocks


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
