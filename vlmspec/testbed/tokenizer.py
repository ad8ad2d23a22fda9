"""Tokenizer and processors of the testbed: the world's words as single tokens, inside the families' real classes.

The tokenizer is a byte-level BPE whose merges are trained on the world's lexicon until every word (with and
without its leading space) is one token, so world texts tokenize word by word while any other text still
encodes (byte by byte). It is wrapped in ``Qwen2Tokenizer`` (the tokenizer class of both families) with the
family's special tokens and a family-style chat template, and handed to the family's real processor class
(``Qwen2VLProcessor`` / ``LlavaOnevisionProcessor``), so ``AutoProcessor.from_pretrained`` works on a saved pair.

Visual tokens for an ``84 x 84`` testbed picture (see ``tests/test_testbed.py``):

* ``qwen2_vl``: 6x6 patches of 14 px merged 2x2 = 9 tokens (one per grid cell); a 4-frame clip 2 x 9 = 18.
* ``llava_onevision``: SigLIP patches of 28 px = 3x3 per crop; anyres with the single pinpoint ``84x84``:
  base crop 9 + tile 9 + 3 row newlines = 21 tokens; a 4-frame clip: 4 x (3x3 pooled to 2x2) + 1 = 17.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..testing import LLAVA_CHAT_TEMPLATE, LLAVA_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE, byte_level_tokenizer
from .world import IMAGE_SIDE, lexicon

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import ProcessorMixin
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

__all__ = ["FAMILIES", "build_processor", "build_tokenizer", "check_family", "special_token_ids"]

FAMILIES: tuple[str, ...] = ("qwen2_vl", "llava_onevision")
"""Families the testbed trains pairs for."""

QWEN_PATCH = 14
LLAVA_PATCH = 28

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def check_family(family: str) -> str:
    """Returns ``family`` or raises ``ValueError`` naming the accepted families."""
    if family not in FAMILIES:
        raise ValueError(f"Unknown testbed family {family!r}; expected one of {', '.join(FAMILIES)}.")
    return family


def _specials(family: str) -> tuple[str, ...]:
    return QWEN_SPECIAL_TOKENS if family == "qwen2_vl" else LLAVA_SPECIAL_TOKENS


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
    return byte_level_tokenizer(
        lines=_corpus(),
        specials=_specials(family),
        chat_template=QWEN_CHAT_TEMPLATE if family == "qwen2_vl" else LLAVA_CHAT_TEMPLATE,
        vocab_size=1 << 16,  # never reached: training stops once every word is a single token
        model_max_length=4096,
    )


def special_token_ids(tokenizer: Qwen2Tokenizer, family: str) -> dict[str, int]:
    """Ids of the family's special tokens plus ``"eos"`` (``<|im_end|>``) and ``"pad"`` (``<|endoftext|>``)."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in _specials(family)}
    ids["eos"] = ids["<|im_end|>"]
    ids["pad"] = ids["<|endoftext|>"]
    return ids


def build_processor(family: str) -> ProcessorMixin:
    """Builds the family's real processor around :func:`build_tokenizer`.

    Args:
        family: One of :data:`FAMILIES`.

    Returns:
        A ``Qwen2VLProcessor`` or ``LlavaOnevisionProcessor``.

    Raises:
        ValueError: If ``family`` is not one of :data:`FAMILIES`.
    """
    tokenizer = build_tokenizer(family)
    chat_template = tokenizer.chat_template
    if family == "qwen2_vl":
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

        side = IMAGE_SIDE
        common = dict(
            size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}, patch_size=QWEN_PATCH, merge_size=2
        )
        return Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(temporal_patch_size=2, **common),
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(
                temporal_patch_size=2,
                min_frames=2,
                max_frames=16,
                do_sample_frames=False,
                cap_pixels_per_frame=False,
                **{**common, "size": {"shortest_edge": side * side, "longest_edge": side * side}},
            ),
            chat_template=chat_template,
        )
    from transformers import (
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    side = IMAGE_SIDE
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(
            size={"height": side, "width": side}, image_grid_pinpoints=[[side, side]]
        ),
        tokenizer=tokenizer,
        video_processor=LlavaOnevisionVideoProcessor(
            size={"height": side, "width": side}, do_sample_frames=False
        ),
        num_image_tokens=(side // LLAVA_PATCH) ** 2,
        vision_feature_select_strategy="full",
        chat_template=chat_template,
        vision_aspect_ratio="anyres_max_9",
    )
