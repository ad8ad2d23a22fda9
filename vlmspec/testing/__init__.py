"""Tiny, randomly initialised, real-architecture VLM target/draft pairs for tests.

Builds miniature checkpoints of four vision-language model families with the *real*
`transformers` config, model, tokenizer and processor classes and saves them with
``save_pretrained``, so tests (and users trying the SDK offline) load them through
``from_pretrained`` exactly like real checkpoints::

    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vlmspec.testing import build_tiny_pair, make_image

    pair = build_tiny_pair("qwen2_vl")  # cached under $VLMSPEC_CACHE or ~/.cache/vlmspec/tiny
    target = AutoModelForImageTextToText.from_pretrained(pair.target)
    draft = AutoModelForImageTextToText.from_pretrained(pair.draft)
    processor = AutoProcessor.from_pretrained(pair.target)

Nothing is downloaded: the tokenizer is a byte-level BPE (so *any* text encodes) trained on an
embedded English word list and wrapped in ``Qwen2Tokenizer``, the tokenizer class of all four
families, with the family's special tokens and a family-style chat template. The tokenizer,
processor and config builders are those of :mod:`vlmspec.family_builders`, shared with the trained
:mod:`vlmspec.testbed`; this module picks the fixtures' sizes and pixel geometry and shapes the
random weights.

Guarantees (checked by ``tests/test_fixtures.py``):

* **Same tokenizer/processor** files in the target and draft folders.
* **Draft = truncated copy of the target**: same width, first ``_DRAFT_LAYERS`` of
  ``_TARGET_LAYERS`` decoder layers; embeddings, vision tower, projector, layers and final norm are
  copied from the target. Its ``lm_head`` is the target's plus seeded noise, so draft greedy
  tokens agree with the target's on ~75% of positions (a plain copy agrees ~97% of the time,
  which would leave the rejection paths of speculative decoding nearly untested).
* **No early stop**: the ``lm_head`` rows of all special tokens (``<|im_end|>``, ``<|endoftext|>``,
  placeholders, ...) are zero, so their logit is exactly 0 while the best ordinary token's is
  positive; greedy decoding never emits EOS/special tokens and always runs to ``max_new_tokens``.
  Tests that need an EOS stop can pass ``eos_token_id=<a token the model emits>`` to ``generate``.
* **Peaked but context-driven greedy decoding** (see :func:`~vlmspec.testing.weights.shape_weights`): each token strongly
  predicts a "successor" (``lm_head`` = permuted embeddings) and sharp attention lets the
  context (text, images, video, i.e. the KV cache) override that for a few percent of the
  tokens. Median top1-top2 gap ~1.8 logit std (random init: ~0.25). Every weight draw is vetted
  on the :func:`make_inputs` prompts (min gap >= 0.1 std, context sensitivity >= 3%) and re-drawn
  deterministically otherwise. Residual risk for *exact bf16* comparisons on other prompts:
  ~0.06% of positions flip between a one-pass and a token-by-token (KV-cache) bf16 forward,
  i.e. ~3% of random 48-token prompts; fp32 comparisons are exact.
* **Deterministic**: the same ``seed`` gives byte-identical folders.

Processor calls (transformers 5.x; the tests use exactly these):

* One image: ``processor(text=[prompt], images=[image], return_tensors="pt")``.
* Several images in one prompt: ``images=[[image1, image2]]`` (nested per prompt; a flat list
  makes LLaVA-OneVision treat each image as its own sample and use the single-image anyres layout).
* Video from PIL frames: ``videos=[frames], video_metadata=[VideoMetadata(total_num_frames=n,
  fps=4.0, frames_indices=list(range(n)))]``. Metadata is only *needed* by Qwen3-VL (timestamps;
  without it the processor warns and assumes 24 fps). ``do_sample_frames=False`` is saved in
  every video processor config, so frames are used as given.
* Video file: ``frames, metadata = read_video(path)`` and pass them as above. ``videos=[path]``
  needs ``torchcodec`` in transformers 5.x, which this project does not install.
* The Qwen processors return ``mm_token_type_ids`` by default (needed for M-RoPE); no flag needed.
"""

from ..family_builders import LLAVA_CHAT_TEMPLATE, LLAVA_SPECIAL_TOKENS, QWEN_CHAT_TEMPLATE
from .drafts import build_tiny_assistant, build_tiny_text_draft
from .media import make_image, make_video_frames, read_video, write_video
from .pairs import (
    FAMILIES,
    FIXTURE_VERSION,
    HYBRID_FAMILIES,
    IMAGE_ONLY_FAMILIES,
    INPUT_KINDS,
    MOE_FAMILIES,
    OWN_TEST_FAMILIES,
    TINY_FAMILIES,
    TinyPair,
    build_processor,
    build_tiny_pair,
    default_cache_root,
    input_kinds,
    make_inputs,
)

__all__ = [
    "FAMILIES",
    "FIXTURE_VERSION",
    "HYBRID_FAMILIES",
    "IMAGE_ONLY_FAMILIES",
    "OWN_TEST_FAMILIES",
    "INPUT_KINDS",
    "MOE_FAMILIES",
    "LLAVA_CHAT_TEMPLATE",
    "LLAVA_SPECIAL_TOKENS",
    "QWEN_CHAT_TEMPLATE",
    "TINY_FAMILIES",
    "TinyPair",
    "build_processor",
    "build_tiny_assistant",
    "build_tiny_pair",
    "build_tiny_text_draft",
    "default_cache_root",
    "input_kinds",
    "make_image",
    "make_inputs",
    "make_video_frames",
    "read_video",
    "write_video",
]
