"""FastVLM (Apple's ``FastVLM-0.5B`` or ``-1.5B`` drafting for ``FastVLM-7B``; transformers' ``fast_vlm``
conversions): FastViTHD, a hybrid convolutional and attention tower that turns a 1024-pixel picture into a 16 x 16
grid of features (a token per 64 x 64 pixels), through a two-layer projector in front of a Qwen2 language model with
1-D RoPE. Few visual tokens for a large picture is the model's point, and what makes its prefill cheap next to the
decoding that speculation speeds up.

Pictures only (a video reaches it as its frames: :func:`vlmspec.conversations.frames_as_pictures`). LLaVA's processor
resizes and centre-crops every picture to the tower's input and writes it as ``image_seq_length`` ``<image>``
tokens, one row of ``pixel_values`` ``[n, C, H, W]`` each: a prompt's media items are its pictures, blocks of a fixed
size (:class:`~.blocks.PlaceholderBlocks`). Positions are the original 1-D prompt indices.
"""

from __future__ import annotations

from .blocks import PlaceholderBlocks


class FastVlmAdapter(PlaceholderBlocks):
    model_types = ("fast_vlm",)
    layout_fields = (  # FastViTHD's tokens per picture (the processor's crop over the tower's 64-pixel grid)
        "vision_config.architecture",
        "image_seq_length",
    )
    # the tower's input
    fixed_processor_settings = frozenset({"size", "crop_size", "do_resize", "do_center_crop"})
    placeholder, block = "<image>", "picture"
    write_hint = "write each picture in the prompt as one <image> and let the processor expand it"

    @property
    def block_tokens(self) -> int:
        """Placeholders per picture: the tower's grid, ``image_seq_length`` (256 for a 1024-pixel picture)."""
        return self.config.image_seq_length
