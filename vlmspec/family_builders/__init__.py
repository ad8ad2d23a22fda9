"""The VLM families' real tokenizer, processor and config classes, built small and offline.

One builder per piece, shared by the two model fixtures of the project: the tiny random pairs of
:mod:`vlmspec.testing` and the trained pairs of :mod:`vlmspec.testbed`. What the two choose
differently is passed in: the model's shape (:class:`ModelSpec`), the pixel geometry shared by a
family's processor and config (:class:`VisionLayout`), the tokenizer's training text and whether the
Qwen vocabulary carries the grounding tokens.

The tokenizer is a byte-level BPE (so *any* text encodes) wrapped in ``Qwen2Tokenizer``, the tokenizer
class of all the families, with the family's special tokens and a family-style chat template.

The builders live by concern: :mod:`.specs` (the families, their classes, shapes and geometry), :mod:`.chat`
(special tokens, chat templates, tokenizers), :mod:`.processors` and :mod:`.configs`.
"""

from __future__ import annotations

from .chat import (
    CHAT_TOKENS,
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_NAMED_TOKENS,
    INTERNVL_CHAT_TEMPLATE,
    INTERNVL_NAMED_TOKENS,
    LLAVA15_CHAT_TEMPLATE,
    LLAVA_CHAT_TEMPLATE,
    LLAVA_SPECIAL_TOKENS,
    QWEN3_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    SMOLVLM_NAMED_TOKENS,
    build_tokenizer,
    byte_level_tokenizer,
    chat_template,
    special_token_ids,
    special_tokens,
)
from .configs import build_config, generation_config
from .processors import build_processor
from .specs import (
    FAMILIES,
    HYBRID_FAMILIES,
    IMAGE_ONLY_FAMILIES,
    MOE_FAMILIES,
    OWN_TEST_FAMILIES,
    QWEN3_FAMILIES,
    ModelSpec,
    VisionLayout,
    model_class,
)

__all__ = [
    "FAMILIES",
    "MOE_FAMILIES",
    "QWEN3_FAMILIES",
    "HYBRID_FAMILIES",
    "LLAVA_CHAT_TEMPLATE",
    "LLAVA15_CHAT_TEMPLATE",
    "OWN_TEST_FAMILIES",
    "IMAGE_ONLY_FAMILIES",
    "CHAT_TOKENS",
    "SMOLVLM_NAMED_TOKENS",
    "LLAVA_SPECIAL_TOKENS",
    "INTERNVL_CHAT_TEMPLATE",
    "INTERNVL_NAMED_TOKENS",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_NAMED_TOKENS",
    "QWEN3_CHAT_TEMPLATE",
    "QWEN_CHAT_TEMPLATE",
    "ModelSpec",
    "VisionLayout",
    "build_config",
    "build_processor",
    "build_tokenizer",
    "byte_level_tokenizer",
    "chat_template",
    "generation_config",
    "model_class",
    "special_token_ids",
    "special_tokens",
]
