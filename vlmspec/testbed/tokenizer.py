"""Tokenizer and processors of the testbed: the world's words as single tokens, inside the families' real classes.

The tokenizer is a byte-level BPE whose merges are trained on the world's lexicon until every word (with and
without its leading space) is one token, so world texts tokenize word by word while any other text still
encodes (byte by byte). It is wrapped in ``Qwen2Tokenizer`` (the tokenizer class of every family) with the
family's special tokens and a family-style chat template, and handed to the family's real processor class
(``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` / ``LlavaOnevisionProcessor`` / ``InternVLProcessor`` /
``Qwen3VLProcessor``), so ``AutoProcessor.from_pretrained`` works on a saved pair.

Visual tokens for an ``84 x 84`` testbed picture (see ``tests/test_testbed.py``):

* ``qwen2_vl`` and ``qwen2_5_vl``: 6x6 patches of 14 px merged 2x2 = 9 tokens (one per grid cell); a 4-frame clip
  2 x 9 = 18.
* ``llava_onevision``: SigLIP patches of 28 px = 3x3 per crop; anyres with the single pinpoint ``84x84``:
  base crop 9 + tile 9 + 3 row newlines = 21 tokens; a 4-frame clip: 4 x (3x3 pooled to 2x2) + 1 = 17.
* ``internvl``: one 84-pixel tile (no thumbnail) of 6x6 patches of 14 px, pixel-shuffled 2x2 = 9 tokens in raster
  order (one per grid cell); a 4-frame clip is 4 tiles, 36 tokens.
* ``qwen3_vl``: Qwen2-VL's grid (14-px patches here; the real tower's are 16 px); a clip is 2 x 9 tokens, each frame
  pair in a vision span of its own after its timestamp (``<0.1 seconds>``, spelled out byte by byte).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .. import family_builders
from ..family_builders import VisionLayout
from .world import IMAGE_SIDE, NUM_FRAMES, lexicon

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import ProcessorMixin
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

__all__ = ["FAMILIES", "LAYOUTS", "build_processor", "build_tokenizer", "check_family", "special_token_ids"]

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "llava_onevision", "internvl", "qwen3_vl")
"""Families the testbed trains pairs for."""

_QWEN_LAYOUT = VisionLayout(
    patch=14,
    image_pixels=(56 * 56, 112 * 112),
    video_pixels=(IMAGE_SIDE * IMAGE_SIDE, IMAGE_SIDE * IMAGE_SIDE),
)
LAYOUTS: dict[str, VisionLayout] = {
    "qwen2_vl": _QWEN_LAYOUT,
    "qwen2_5_vl": _QWEN_LAYOUT,  # the same grid; its tower attends within 56-pixel windows but in its last block
    # the same grid (Qwen3-VL's real patches are 16 px: 14 keeps one merged token per 28-pixel grid cell); its
    # video processor bounds the pixels of a whole clip, not of one frame
    "qwen3_vl": replace(_QWEN_LAYOUT, video_pixels=(NUM_FRAMES * IMAGE_SIDE * IMAGE_SIDE,) * 2),
    "llava_onevision": VisionLayout(patch=28, crop_side=IMAGE_SIDE),  # one pinpoint: the picture itself
    # one tile, the picture itself: 6 x 6 patches, pixel-shuffled 2 x 2 into one token per grid cell
    "internvl": VisionLayout(patch=IMAGE_SIDE // 6, crop_side=IMAGE_SIDE),
}
"""Pixel geometry of each family's processor and config."""


def check_family(family: str) -> str:
    """Returns ``family`` or raises ``ValueError`` naming the accepted families."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown testbed family {family!r}; expected one of {', '.join(FAMILIES)}.")
    return family


def _specials(family: str) -> tuple[str, ...]:
    return family_builders.special_tokens(family, grounding=False)


def _corpus() -> list[str]:
    """Lines in which every lexicon word occurs at a line start and after a space."""
    return [f"{word} {word}" for word in lexicon()] + ["\n", " \n"]


def build_tokenizer(family: str) -> Qwen2Tokenizer:
    """Trains the word-level byte BPE and wraps it in ``Qwen2Tokenizer`` with the family's specials.

    Args:
        family: One of :data:`FAMILIES`.

    Returns:
        The tokenizer; ``eos_token`` is ``<|im_end|>`` (end of a reply), ``pad_token`` ``<|endoftext|>``.
    """
    check_family(family)
    return family_builders.build_tokenizer(
        family,
        _corpus(),
        grounding=False,
        vocab_size=1 << 16,  # never reached: training stops once every word is a single token
        model_max_length=4096,
    )


def special_token_ids(tokenizer: Qwen2Tokenizer, family: str) -> dict[str, int]:
    """Ids of the family's special tokens plus ``"eos"`` (``<|im_end|>``) and ``"pad"`` (``<|endoftext|>``)."""
    return family_builders.special_token_ids(tokenizer, _specials(family))


def build_processor(family: str) -> ProcessorMixin:
    """Builds the family's real processor around :func:`build_tokenizer`.

    Args:
        family: One of :data:`FAMILIES`.

    Returns:
        The family's processor (``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``LlavaOnevisionProcessor``,
        ``InternVLProcessor``, ``Qwen3VLProcessor``).

    Raises:
        ValueError: If ``family`` is not one of :data:`FAMILIES`.
    """
    return family_builders.build_processor(family, build_tokenizer(family), LAYOUTS[family])
