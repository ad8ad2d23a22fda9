"""Building the tiny pairs: the fixtures' sizes, weights shaped and vetted, folders written once and cached
(see :mod:`vlmspec.testing`)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from .. import family_builders
from ..family_builders import (
    ModelSpec,
    VisionLayout,
    build_config,
    build_tokenizer,
    generation_config,
    model_class,
    special_tokens,
)
from .media import make_image, make_video_frames
from .weights import calibrate_vision, perturb_draft_head, shape_weights

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, ProcessorMixin
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer


FAMILIES: tuple[str, ...] = family_builders.FAMILIES
"""The dense model families :func:`build_tiny_pair` builds: the test matrix."""
MOE_FAMILIES: tuple[str, ...] = family_builders.MOE_FAMILIES
"""The mixture-of-experts families it builds too (a Qwen3-VL-MoE pair; its tests are its own)."""
IMAGE_ONLY_FAMILIES: tuple[str, ...] = family_builders.IMAGE_ONLY_FAMILIES
"""The families without video it builds too (Gemma 3, LLaVA-1.5 and LLaVA-NeXT pairs; tested on their own)."""
OWN_TEST_FAMILIES: tuple[str, ...] = family_builders.OWN_TEST_FAMILIES
"""The families with pictures and videos it builds that are tested on their own (a SmolVLM2 pair)."""
HYBRID_FAMILIES: tuple[str, ...] = family_builders.HYBRID_FAMILIES
"""The families it builds whose language models have recurrent layers (a Qwen3.5 pair, among the own-test ones)."""
TINY_FAMILIES: tuple[str, ...] = (*FAMILIES, *MOE_FAMILIES, *IMAGE_ONLY_FAMILIES, *OWN_TEST_FAMILIES)
"""Every family :func:`build_tiny_pair` builds (``tiny:<family>`` names one)."""

INPUT_KINDS: tuple[str, ...] = ("image", "two_images", "video", "text")
"""Canonical input kinds of :func:`make_inputs`."""


def input_kinds(family: str) -> tuple[str, ...]:
    """The canonical input kinds ``family``'s models take (no ``"video"`` for a pictures-only family)."""
    return tuple(k for k in INPUT_KINDS if k != "video") if family in IMAGE_ONLY_FAMILIES else INPUT_KINDS


FIXTURE_VERSION = "3"
"""Bumped whenever the fixture recipe changes, so stale cached folders are not reused."""

_COMPLETE_MARKER = "VLMSPEC_TINY_COMPLETE"

# ---------------------------------------------------------------------------------------------
# Model sizes and geometry
# ---------------------------------------------------------------------------------------------
_TARGET_LAYERS = 4
_DRAFT_LAYERS = 2
_SPEC = ModelSpec(
    hidden=64,
    layers=_TARGET_LAYERS,
    kv_heads=2,
    intermediate=128,
    vision_hidden=32,
    vision_layers=2,
    vision_heads=2,
    head_dim=16,  # 4 heads; rotary half-dim 8
    init_std=0.02,
)
_QWEN2_LAYOUT = VisionLayout(patch=14, image_pixels=(56 * 56, 112 * 112), video_pixels=(56 * 56, 112 * 112))
_LAYOUTS = {
    "qwen2_vl": _QWEN2_LAYOUT,
    "glm46v": _QWEN2_LAYOUT,  # the same patches of 14, merged 2 x 2
    "qwen2_5_vl": _QWEN2_LAYOUT,
    "qwen3_vl": VisionLayout(
        patch=16, image_pixels=(64 * 64, 128 * 128), video_pixels=(64 * 64, 4 * 128 * 128)
    ),
    "qwen3_vl_moe": VisionLayout(  # Qwen3-VL's: a dense qwen3_vl draft fits a qwen3_vl_moe target
        patch=16, image_pixels=(64 * 64, 128 * 128), video_pixels=(64 * 64, 4 * 128 * 128)
    ),
    "qwen3_5": VisionLayout(  # Qwen3-VL's tower and processor
        patch=16, image_pixels=(64 * 64, 128 * 128), video_pixels=(64 * 64, 4 * 128 * 128)
    ),
    # SigLIP input side 28: 2x2 patches of 14 -> 4 tokens per crop; anyres grids of 1x1 to 2x2 crops
    "llava_onevision": VisionLayout(patch=14, crop_side=28, anyres_tiles=(1, 2)),
    # tiles of 28: 4x4 patches of 7 -> 4 tokens per tile; a picture is cut into up to 4 tiles (plus a thumbnail)
    "internvl": VisionLayout(patch=7, crop_side=28, max_tiles=4),
    "internvl_moe": VisionLayout(patch=7, crop_side=28, max_tiles=4),  # InternVL's, a sparse language model
    # SigLIP input side 28: 4x4 patches of 7, average-pooled 2x2 -> 4 tokens per picture
    "gemma3": VisionLayout(patch=7, crop_side=28),
    # patches of 4 pooled 2x2: a 56-pixel square resized to 64 x 64 pixels, 8x8 tokens (70 at most, a picture or frame)
    "gemma4": VisionLayout(patch=4),
    # CLIP input side 28: 2x2 patches of 14 -> 4 tokens per picture (the CLS token dropped, as LLaVA-1.5 does)
    "llava": VisionLayout(patch=14, crop_side=28),
    # LLaVA-1.5's, a picture also cut into the anyres grid of 1x1 to 2x2 crops that fits it best
    "llava_next": VisionLayout(patch=14, crop_side=28, anyres_tiles=(1, 2)),
    # LLaVA-NeXT's; a video frame one crop of 2x2 patches, pooled 2x2 -> 1 token per frame
    "llava_next_video": VisionLayout(patch=14, crop_side=28, anyres_tiles=(1, 2)),
    # tiles of 28: 4x4 patches of 7, shuffled 2x2 into one -> 4 tokens per tile; a picture up to 2x2 tiles + itself
    "smolvlm": VisionLayout(patch=7, crop_side=28),
    "idefics3": VisionLayout(patch=7, crop_side=28),  # SmolVLM2's
    # patches of 7 merged 2x2 -> a token per 14 pixels; a picture's longest side at most 56: up to 4x4 tokens
    "mistral3": VisionLayout(patch=7, crop_side=56),
    # tiles of 28: 4x4 patches of 7, shuffled 2x2 -> 4 tokens per tile; a picture up to 4 tiles (plus the whole)
    "aya_vision": VisionLayout(patch=7, crop_side=28, max_tiles=4),
    # tiles of 28: 4x4 patches of 7, strided 2x2 -> 4 tokens per tile; the whole picture, then up to 4 tiles
    "ovis2": VisionLayout(patch=7, crop_side=28, max_tiles=4),
    # FastViTHD: a token per 64 x 64 pixels (a stride-4 stem, four stages halving) -> 4 tokens a 128-pixel picture
    "fast_vlm": VisionLayout(patch=64, crop_side=128),
    # tiles of 32: 4x4 patches of 8, pooled 2x2 -> 4 tokens per tile; a thumbnail and up to 4 tiles, a frame one tile
    "perception_lm": VisionLayout(patch=8, crop_side=32, max_tiles=4),
    "lfm3_vl": VisionLayout(  # Qwen2-VL's patches (of Qwen3-VL's 16 pixels) and Qwen3-VL's video processor
        patch=16, image_pixels=(64 * 64, 128 * 128), video_pixels=(64 * 64, 4 * 128 * 128)
    ),
    # patches of 4 merged 2x2 twice: a picture whole near 32 pixels a side (an 8x8 grid: 4 tokens) and, when larger,
    # up to 4 slices of about as many; a video's frames whole
    "minicpmv4_6": VisionLayout(patch=4, crop_side=32, max_tiles=4),
    "minicpmv4_7": VisionLayout(patch=4, crop_side=32, max_tiles=4),  # 4.6's
    # patches of 4 unshuffled 2x2: a picture up to 2048 pixels whole (4 to 16 tokens at its aspect ratio), a larger
    # one cut into 2 to 4 tiles of 16 pixels (4 tokens each) and a thumbnail (a 56-pixel square: 2x2 tiles + 16)
    "lfm2_vl": VisionLayout(patch=4, crop_side=16, max_tiles=4),
    # SigLIP input side 28 (a picture padded to a square): 2x2 patches of 14 -> 4 tokens per picture
    "janus": VisionLayout(patch=14, crop_side=28),
    "deepseek_vl": VisionLayout(patch=14, crop_side=28),  # Janus's
    "deepseek_vl_hybrid": VisionLayout(patch=14, crop_side=28),  # and a SAM encoder's HIGH_RES_SIDE
    # patches of 14: a picture resized to at most 28 x 56 pixels, a token per patch -> 4 tokens a 56-pixel square; a
    # video's frames share its pixel budget (4 frames: 56 pixels a side each), 4x4 patches merged 2x2 -> 4 tokens a
    # frame, fewer where a frame repeats the one before
    "video_llama_3": VisionLayout(
        patch=14, image_pixels=(28 * 28, 28 * 56), video_pixels=(56 * 56, 4 * 56 * 56)
    ),
}
_SLIDING_WINDOW = 24
"""Gemma 3's local window in the fixtures: a prompt with a picture is ~30 tokens, so 48 new tokens run past it."""
_BPE_VOCAB = 960  # byte-level BPE size before special tokens

# Weight draws are vetted on calibration prompts (see _build_models).
_CALIBRATION_TOKENS = 48
_MIN_MARGIN = 0.1  # logit standard deviations
_FAMILY_MIN_MARGIN = {
    "glm46v": 0.08,
    "gemma4": 0.06,
    "perception_lm": 0.06,
    "qwen3_5": 0.05,
    "minicpmv4_6": 0.08,
    "minicpmv4_7": 0.08,
}
"""Families no draw of the first 120 (Gemma 4: 150; Qwen3.5, MiniCPM-V and Perception LM: 32) gives ``_MIN_MARGIN``: the best one's margin is accepted (the fp32
lossless checks compare exact tokens; a near-tie there would show as a mismatch, not pass unseen)."""
_MIN_SENSITIVITY = 0.03
_MAX_SENSITIVITY = 0.3
_MAX_DRAWS = 32
# The draw the search accepted for each (family, seed) with today's pinned dependencies, vetted first: when it
# still passes, a build vets one draw instead of up to 28 (qwen2_5_vl's is draw 27: ~20 s of greedy runs on a
# 2-core CPU, paid again by every fresh test session). A known draw that fails the vetting (other dependency
# versions) only costs its one vetting: the search then runs as if it were not known.
_KNOWN_DRAWS: dict[tuple[str, int], int] = {
    ("qwen2_vl", 0): 4,
    ("qwen2_5_vl", 0): 27,
    ("qwen3_vl", 0): 20,
    ("llava_onevision", 0): 2,
    ("internvl", 0): 14,
    ("qwen3_vl_moe", 0): 14,
    ("gemma3", 0): 6,
    ("llava", 0): 53,  # 53 and 41: no draw below _MAX_DRAWS passes; found by searching further
    ("llava_next", 0): 41,
    ("smolvlm", 0): 19,
    ("idefics3", 0): 5,
    ("llava_next_video", 0): 10,
    ("mistral3", 0): 34,  # found by searching past _MAX_DRAWS, as llava's
    ("glm46v", 0): 93,  # the best of the first 120 (_FAMILY_MIN_MARGIN)
    ("internvl_moe", 0): 19,
    ("aya_vision", 0): 34,  # found by searching past _MAX_DRAWS, as llava's
    ("ovis2", 0): 28,
    ("janus", 0): 3,
    ("deepseek_vl", 0): 4,
    ("deepseek_vl_hybrid", 0): 0,
    ("video_llama_3", 0): 35,  # found by searching past _MAX_DRAWS, as llava's
    ("fast_vlm", 0): 86,  # found by searching past _MAX_DRAWS, as llava's
    ("gemma4", 0): 107,  # the best of the first 150 (_FAMILY_MIN_MARGIN)
    ("perception_lm", 0): 28,  # the best of the first 32 (_FAMILY_MIN_MARGIN)
    ("qwen3_5", 0): 30,  # the best of the first 32 (_FAMILY_MIN_MARGIN)
    ("lfm2_vl", 0): 29,
    ("lfm3_vl", 0): 15,
    ("minicpmv4_6", 0): 10,  # the best of the first 32 (_FAMILY_MIN_MARGIN)
    ("minicpmv4_7", 0): 7,  # the best of the first 32 (_FAMILY_MIN_MARGIN)
}

_CORPUS = """
Describe this image. Describe the image in detail. Describe this video. What is in the image?
What is shown in this picture? What happens in the video? What color is the square? How many
objects are there? Is there a circle in the image? Where is the red ball? Compare the two images.
What is the difference between the first and the second picture? Summarize the video in one
sentence. Answer the question with a single word. Please explain your answer. Write a short story
about the scene. Tell me what you see. Can you read the text in the image? Count the shapes.
The image shows a red circle on a blue background. There is a green square next to a yellow
triangle. A small white dog is running across the grass in the park. Two people are sitting at a
table near the window. The sky is bright and the sun is shining over the mountains. A black cat
sleeps on the brown sofa. The video shows a car driving down a long road at night. A man is
walking his dog along the river. A woman is reading a book under a large tree. Children are
playing football on the field. The kitchen has a white table, four chairs and a bowl of fruit.
There are three apples, two bananas and one orange. The building is tall and made of glass and
steel. Boats float on the calm water of the lake. Birds fly above the city in the morning light.
The picture is dark, so it is hard to see the details. The first frame shows a person standing,
and the last frame shows the person sitting. In the beginning, the camera moves to the left, then
it stops. The answer is yes. The answer is no. I think the object is a cup. It looks like a map of
the world. The number on the sign is seven. The text says hello world. This is a photo of a street
with many shops, lights and people. The weather is cold and snowy. It is a warm summer day at the
beach with sand, waves and blue water. The train arrives at the station and the doors open.
Here is a chart with lines, bars and numbers. The table lists the name, the date and the price.
The quick brown fox jumps over the lazy dog. Once upon a time there was a little girl who lived
in a small house near the forest. She liked to draw pictures of animals, flowers and stars.
One day she found a strange box with a key inside. You are a helpful assistant. Sure, here is a
description. The main object is in the center of the frame. On the left side there is a door and
on the right side there is a lamp. The colors are red, orange, yellow, green, blue, purple, pink,
black, white, gray and brown. Shapes: circle, square, triangle, rectangle, line, dot, star.
Numbers: zero one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9 10 100.
Questions: who, what, when, where, why, how, which. Words: good, bad, big, small, new, old, first,
last, long, short, high, low, open, close, up, down, in, out, on, off, over, under, again, then,
because, before, after, while, during, about, around, between, through, with, without, very,
really, also, only, just, still, every, each, some, any, all, both, few, more, most, other, such.
"""


@dataclass(frozen=True)
class TinyPair:
    """Locations of a tiny target/draft checkpoint pair.

    Attributes:
        family: One of :data:`FAMILIES`.
        target: Folder with the target model (safetensors) plus processor/tokenizer files.
        draft: Folder with the smaller draft model and the *same* processor/tokenizer files.
    """

    family: str
    target: Path
    draft: Path


# ---------------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------------
def _check_family(family: str) -> str:
    if family not in TINY_FAMILIES:
        raise ValueError(
            f"Unknown model family {family!r}; expected one of {', '.join(TINY_FAMILIES)}. "
            "Pass one of these names to build_tiny_pair()/build_processor()."
        )
    return family


# ---------------------------------------------------------------------------------------------
# Tokenizer, processor, config (the builders shared with the testbed, with the fixtures' choices)
# ---------------------------------------------------------------------------------------------
def _build_tokenizer(family: str) -> Qwen2Tokenizer:
    """The fixtures' tokenizer: a small byte-level BPE on :data:`_CORPUS` with the family's specials and template."""
    return build_tokenizer(
        family, _corpus_lines(), grounding=True, vocab_size=_BPE_VOCAB, model_max_length=32768
    )


def _build_base_tokenizer(family: str) -> Qwen2Tokenizer:
    """The fixtures' tokenizer before the family's special tokens were added: the same BPE and the chat tokens that
    come before the family's first own token (what a VLM's language model had before its tokenizer learnt the
    pictures' tokens; SmolVLM's tokenizer names its own tokens before ``<|im_start|>``)."""
    from ..family_builders import CHAT_TOKENS, byte_level_tokenizer, chat_template

    full = _build_tokenizer(family).added_tokens_decoder
    chat = tuple(
        itertools.takewhile(lambda token: token in CHAT_TOKENS, (full[i].content for i in sorted(full)))
    )
    return byte_level_tokenizer(_corpus_lines(), chat, chat_template(family), _BPE_VOCAB, 32768)


def _corpus_lines() -> list[str]:
    return [line.strip() for line in _CORPUS.strip().splitlines() if line.strip()]


def build_processor(family: str) -> ProcessorMixin:
    """Builds the family's real processor class around a locally trained tokenizer.

    Image/video sizes are tiny so a :func:`make_image` picture becomes a handful of visual tokens
    (see ``tests/test_fixtures.py`` for the exact counts).

    Args:
        family: One of :data:`FAMILIES`.

    Returns:
        A ``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor`` or
        ``LlavaOnevisionProcessor`` with its chat template set.

    Raises:
        ValueError: If ``family`` is not one of :data:`FAMILIES`.
    """
    _check_family(family)
    return family_builders.build_processor(family, _build_tokenizer(family), _LAYOUTS[family])


def _build_config(family: str, tokenizer: Qwen2Tokenizer, num_layers: int) -> Any:
    """Builds a tiny config of the family's real config class."""
    spec = dataclasses.replace(_SPEC, layers=num_layers, sliding_window=_SLIDING_WINDOW)
    return build_config(family, spec, tokenizer, _LAYOUTS[family], explicit_head_dim=False)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def _special_token_ids(tokenizer: Qwen2Tokenizer, family: str) -> list[int]:
    return sorted(tokenizer.convert_tokens_to_ids(t) for t in special_tokens(family, grounding=True))


def make_inputs(processor: ProcessorMixin, kind: str) -> Any:
    """Builds one of the canonical test inputs with the processor's chat template.

    These are the prompts ``tests/test_fixtures.py`` uses and the ones every weight draw is vetted
    on (see :func:`build_tiny_pair`), so they are safe for exact bf16 comparisons.

    Args:
        processor: A processor from :func:`build_processor` or loaded from a fixture folder.
        kind: ``"image"`` (one :func:`make_image`), ``"two_images"`` (two images in one prompt),
            ``"video"`` (4 PIL frames + metadata) or ``"text"``.

    Returns:
        The processor's ``BatchFeature`` (``return_tensors="pt"``, batch of one).

    Raises:
        ValueError: If ``kind`` is not one of :data:`INPUT_KINDS`.
    """
    from transformers.video_utils import VideoMetadata

    if kind not in INPUT_KINDS:
        raise ValueError(f"Unknown input kind {kind!r}; expected one of {', '.join(INPUT_KINDS)}.")
    content: list[dict[str, Any]] = []
    media: dict[str, Any] = {}
    if kind == "image":
        content = [{"type": "image"}, {"type": "text", "text": "Describe this image."}]
        media = {"images": [make_image(0)]}
    elif kind == "two_images":
        content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare the two images."}]
        media = {"images": [[make_image(1), make_image(2)]]}  # nested: both belong to one prompt
    elif kind == "video":
        frames = make_video_frames(3)
        content = [{"type": "video"}, {"type": "text", "text": "What happens in the video?"}]
        metadata = VideoMetadata(
            total_num_frames=len(frames), fps=4.0, frames_indices=list(range(len(frames)))
        )
        media = {"videos": [frames], "video_metadata": [metadata]}
    else:
        content = [{"type": "text", "text": "Tell me a short story about a dog."}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor(text=[prompt], return_tensors="pt", **media)


def _vet_draw(model: PreTrainedModel, calibration: list[Any]) -> tuple[float, float]:
    """Scores a weight draw on the canonical inputs.

    Returns:
        ``(min_margin, sensitivity)``: the smallest top1-top2 logit gap (in logit standard
        deviations) over greedy runs, and the fraction of a run's tokens whose teacher-forced
        prediction changes when the prompt is swapped for another canonical one.
    """
    from ..scores import continuation_logits, greedy_logits

    margins, continuations = [], []
    for inputs in calibration:
        new, logits = greedy_logits(model, inputs, _CALIBRATION_TOKENS)
        scores = logits[0]  # [T, V]; greedy with the pair's generation config: no logits processors
        top2 = scores.topk(2, dim=-1).values
        margins.append(((top2[:, 0] - top2[:, 1]) / scores.std(dim=-1)).min().item())
        continuations.append(new[0])
    changed = 0
    for i, continuation in enumerate(continuations):
        other = calibration[(i + 1) % len(calibration)]  # teacher-forced on another prompt
        changed += int((continuation_logits(model, other, continuation).argmax(-1) != continuation).sum())
    return min(margins), changed / sum(len(c) for c in continuations)


def _build_models(
    family: str, processor: ProcessorMixin, seed: int
) -> tuple[PreTrainedModel, PreTrainedModel, dict[str, Any]]:
    """Builds the target and its truncated-copy draft.

    Returns:
        ``(target, draft, info)`` where ``info`` records the accepted weight draw and its
        calibration margin.
    """
    import torch

    tokenizer = processor.tokenizer
    cls = model_class(family)
    special_ids = _special_token_ids(tokenizer, family)
    with torch.random.fork_rng(devices=[]):  # deterministic without disturbing the caller's RNG
        torch.manual_seed(seed)
        target = cls(_build_config(family, tokenizer, _TARGET_LAYERS)).eval()
        draft = cls(_build_config(family, tokenizer, _DRAFT_LAYERS)).eval()
    target.generation_config = generation_config(tokenizer)
    calibrate_vision(target, family, processor)

    # A weight draw is a roll of the dice: it may leave a near-tie where all prompts share context
    # (right after the assistant header; it would hit every test) or, the other way round, let the
    # embeddings drown the context (outputs then ignore images and KV-cache contents). Draws are
    # vetted on the canonical inputs and re-drawn (deterministically) until both are fine.
    calibration = [make_inputs(processor, kind) for kind in input_kinds(family)]
    best: tuple[tuple[bool, float], int] | None = None
    known = _KNOWN_DRAWS.get((family, seed))
    for draw in ([known] if known is not None else []) + [d for d in range(_MAX_DRAWS) if d != known]:
        draw_seed = (seed + 1) * 1_000_003 + draw
        shape_weights(target, special_ids, draw_seed)
        margin, sensitivity = _vet_draw(target, calibration)
        key = (_MIN_SENSITIVITY <= sensitivity <= _MAX_SENSITIVITY, margin)
        if best is None or key > best[0]:
            best, best_stats = (key, draw_seed), (margin, sensitivity)
        if margin >= _FAMILY_MIN_MARGIN.get(family, _MIN_MARGIN) and key[0]:
            break
    assert best is not None
    if best[1] != draw_seed:
        shape_weights(target, special_ids, best[1])
    target_state = target.state_dict()
    draft_state = {k: _leading(target_state.get(k), v.shape) for k, v in draft.state_dict().items()}
    missing = [k for k, v in draft_state.items() if v is None]
    if missing:  # pragma: no cover - guards against transformers renaming parameters
        raise RuntimeError(f"Cannot copy target weights into the draft for {family!r}: {missing[:5]}")
    draft.load_state_dict(draft_state, strict=True)
    perturb_draft_head(draft, special_ids, seed)

    draft.generation_config = generation_config(tokenizer)
    info = {
        "weight_draw_seed": best[1],
        "vetted_min_margin_std": round(best_stats[0], 4),
        "vetted_context_sensitivity": round(best_stats[1], 4),
    }
    return target, draft, info


def _leading(weight: Any, shape: Any) -> Any:
    """The draft's copy of a target ``weight`` of its ``shape``: the weight itself, or its leading part where the
    draft's is smaller because it has fewer layers (Gemma 4's per-layer inputs pack every layer's in one tensor,
    layer by layer); ``None`` where the target has no such weight."""
    fits = weight is not None and weight.ndim == len(shape)
    if not fits or any(t < d for t, d in zip(weight.shape, shape, strict=True)):
        return None
    return weight[tuple(slice(0, d) for d in shape)]


# ---------------------------------------------------------------------------------------------
# Build / cache
# ---------------------------------------------------------------------------------------------
def default_cache_root() -> Path:
    """Returns the default fixture cache: ``$VLMSPEC_CACHE`` or ``~/.cache/vlmspec/tiny``."""
    env = os.environ.get("VLMSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vlmspec" / "tiny"


def _is_complete(folder: Path) -> bool:
    return (
        (folder / _COMPLETE_MARKER).is_file() and (folder / "target").is_dir() and (folder / "draft").is_dir()
    )


def build_tiny_pair(family: str, root: str | Path | None = None, seed: int = 0) -> TinyPair:
    """Builds (or reuses) a tiny randomly initialised target/draft checkpoint pair.

    The pair lives in ``<root>/<family>-seed<seed>-v<FIXTURE_VERSION>/{target,draft}``. A marker
    file is written last; if it exists the folders are reused without rebuilding. Building writes
    to a private temporary folder first and renames it into place under a file lock, so concurrent
    builders (e.g. pytest-xdist workers) never see half-written checkpoints and the pair is built once.

    Args:
        family: One of :data:`FAMILIES`.
        root: Cache folder. Defaults to ``$VLMSPEC_CACHE`` or ``~/.cache/vlmspec/tiny``.
        seed: Seed of the random initialisation. The language-model weights are re-drawn from
            seeds derived from it until they pass the vetting on :func:`make_inputs` (peaked
            logits, context sensitivity); the accepted draw is recorded in the marker file.

    Returns:
        The :class:`TinyPair` with the ``target`` and ``draft`` folders.

    Raises:
        ValueError: If ``family`` is not one of :data:`FAMILIES`.
    """
    _check_family(family)
    root_path = Path(root).expanduser() if root is not None else default_cache_root()
    folder = root_path / f"{family}-seed{int(seed)}-v{FIXTURE_VERSION}"
    if _is_complete(folder):
        return TinyPair(family=family, target=folder / "target", draft=folder / "draft")
    root_path.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root_path / f".{folder.name}.lock")):  # concurrent builders wait for the first one
        _build_into(family, seed, root_path, folder)
    return TinyPair(family=family, target=folder / "target", draft=folder / "draft")


def _build_into(family: str, seed: int, root_path: Path, folder: Path) -> None:
    """Builds the pair in a private staging folder and renames it into place (the caller holds the lock)."""
    if _is_complete(folder):  # built by the builder we waited for
        return
    staging = root_path / f".{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        with _build_environment():
            _write_pair(family, seed, staging)
        if folder.exists():
            shutil.rmtree(folder)  # a crashed earlier build
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _build_environment() -> Iterator[None]:
    """Single-threaded torch and no "Writing model shards" bars while building; both restored.

    One thread is faster for these tiny models and makes the vetting of weight draws (which
    compares fp32 margins against thresholds) independent of the machine's core count.
    """
    import torch
    from transformers.utils import logging as hf_logging

    threads = torch.get_num_threads()
    bars = hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(1)
    if bars:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if bars:
            hf_logging.enable_progress_bar()


def _write_pair(family: str, seed: int, out: Path) -> None:
    """Builds the processor and both models and saves them under ``out``."""
    processor = build_processor(family)
    target, draft, draw_info = _build_models(family, processor, seed)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(out / name)
        processor.save_pretrained(out / name)
    info = {
        "family": family,
        "seed": seed,
        "fixture_version": FIXTURE_VERSION,
        "target_layers": _TARGET_LAYERS,
        "draft_layers": _DRAFT_LAYERS,
        "vocab_size": len(processor.tokenizer),
        **draw_info,
    }
    (out / _COMPLETE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
