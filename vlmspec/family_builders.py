"""The VLM families' real tokenizer, processor and config classes, built small and offline.

One builder per piece, shared by the two model fixtures of the project: the tiny random pairs of
:mod:`vlmspec.testing` and the trained pairs of :mod:`vlmspec.testbed`. What the two choose
differently is passed in: the model's shape (:class:`ModelSpec`), the pixel geometry shared by a
family's processor and config (:class:`VisionLayout`), the tokenizer's training text and whether the
Qwen vocabulary carries the grounding tokens.

The tokenizer is a byte-level BPE (so *any* text encodes) wrapped in ``Qwen2Tokenizer``, the tokenizer
class of all the families, with the family's special tokens and a family-style chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import GenerationConfig, PreTrainedModel, ProcessorMixin
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

__all__ = [
    "FAMILIES",
    "MOE_FAMILIES",
    "QWEN3_FAMILIES",
    "LLAVA_CHAT_TEMPLATE",
    "LLAVA15_CHAT_TEMPLATE",
    "OWN_TEST_FAMILIES",
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
    "generation_config",
    "model_class",
    "special_token_ids",
    "special_tokens",
]

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_onevision", "internvl")
"""The dense families with pictures and videos these builders know (the fixtures' test matrix)."""
IMAGE_ONLY_FAMILIES: tuple[str, ...] = ("gemma3", "llava", "llava_next", "idefics3", "mistral3")
"""Families these builders know whose models read pictures only (Gemma 3, LLaVA-1.5, LLaVA-NeXT, Idefics3, Mistral 3: no
video input),
tested on their own."""
OWN_TEST_FAMILIES: tuple[str, ...] = ("smolvlm", "llava_next_video", "glm46v")
"""Families with pictures and videos these builders know that are tested on their own (SmolVLM2: pictures cut into
tiles, a video's frames written as pictures with their times; LLaVA-NeXT-Video: LLaVA-NeXT's pictures, a video's
frames pooled; GLM-4.6V: Qwen2-VL's design, a video's frames written with the pictures' placeholder)."""
MOE_FAMILIES: tuple[str, ...] = ("qwen3_vl_moe",)
"""Mixture-of-experts families these builders know too: Qwen3-VL-30B-A3B's and -235B-A22B's architecture, the
Qwen3-VL vision tower and processor with a sparse language model (every layer routes each token to
:data:`MOE_EXPERTS_PER_TOKEN` of :data:`MOE_EXPERTS` experts)."""
QWEN3_FAMILIES: tuple[str, ...] = ("qwen3_vl", "qwen3_vl_moe")
"""The families with Qwen3-VL's vision tower, processor and interleaved M-RoPE."""
MOE_EXPERTS, MOE_EXPERTS_PER_TOKEN = 4, 2

_CLASS_NAMES = {  # family: (config, model, processor) classes of transformers
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor"),
    "llava_onevision": (
        "LlavaOnevisionConfig",
        "LlavaOnevisionForConditionalGeneration",
        "LlavaOnevisionProcessor",
    ),
    "internvl": ("InternVLConfig", "InternVLForConditionalGeneration", "InternVLProcessor"),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", "Gemma3Processor"),
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", "LlavaProcessor"),
    "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration", "LlavaNextProcessor"),
    "llava_next_video": (
        "LlavaNextVideoConfig",
        "LlavaNextVideoForConditionalGeneration",
        "LlavaNextVideoProcessor",
    ),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", "SmolVLMProcessor"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", "Idefics3Processor"),
    "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration", "PixtralProcessor"),
    "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration", "Glm46VProcessor"),
}
_TILE_FAMILIES = ("smolvlm", "idefics3")
"""SmolVLM2 and Idefics3 (SmolVLM 1): the same tokens, tiles and chat template; Idefics3 has no video processor."""
_MISTRAL3_MERGE = 2
"""Mistral 3's ``spatial_merge_size`` in the fixtures (the real models': 2)."""
_LLAVA15_FAMILIES = ("llava", "llava_next", "llava_next_video")
"""LLaVA-1.5 and its successors: a CLIP tower, a Llama language model, LLaVA-1.5's chat (NeXT-Video's with videos)."""
_MROPE_SECTIONS = {
    16: [2, 3, 3],
    32: [4, 6, 6],
    64: [8, 12, 12],
}  # rotary half-dim split, Qwen2-VL's proportions
_QWEN3_MROPE_SECTIONS = {16: [4, 2, 2], 32: [6, 5, 5]}  # interleaved; 32: the real [24, 20, 20] / 4
_VISION_INIT_STD = 0.02

CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The special tokens every family's fixture tokenizer starts with (its end of text, turns and replies)."""
_GROUNDING_TOKENS = (
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
)
_QWEN_VISION_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
LLAVA_SPECIAL_TOKENS = (*CHAT_TOKENS, "<image>", "<video>")
INTERNVL_NAMED_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
"""InternVL's named special tokens (its tokenizer's attributes, which its processor reads): a picture is written
``<img>`` + one ``<IMG_CONTEXT>`` per visual token + ``</img>``, a video ``<video>`` until the processor writes
its frames so."""
GEMMA3_NAMED_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
"""Gemma 3's named special tokens: a picture is written ``<start_of_image>`` in the text, which the processor
expands to ``<start_of_image>`` + one ``<image_soft_token>`` per visual token + ``<end_of_image>``."""
SMOLVLM_NAMED_TOKENS = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "end_of_utterance_token": "<end_of_utterance>",
    "global_image_token": "<global-img>",
}
"""SmolVLM's named special tokens: a picture is written ``<image>`` in the text, which the processor expands to each
tile's ``<fake_token_around_image><row_r_col_c>`` + ``<image>`` per visual token, then the whole picture's
``<global-img>`` tile; a turn ends with ``<end_of_utterance>``."""
_SMOLVLM_GRID = 2
"""Tiles per side of the largest SmolVLM picture the builders lay out (the ``<row_r_col_c>`` tokens they name)."""

QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3-VL: identical except a video is emitted as a bare ``<|video_pad|>``. The transformers 5.x
# Qwen3VLProcessor expands that token to ``<t seconds><|vision_start|>...<|vision_end|>`` per temporal
# patch; with the hub template's outer ``<|vision_start|>...<|vision_end|>`` wrapper (kept by the
# generic placeholder replacement in 5.x) the text would carry a redundant extra wrapper, which the
# reference Qwen3-VL processor never produced.
QWEN3_CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace(
    "<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>"
)

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\n' + content['text'] }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# LLaVA-1.5's (``llava-hf/llava-1.5-7b-hf``'s): ``USER: `` then the turn's pictures, each ``<image>`` on a line of
# its own, then its texts; ``ASSISTANT:`` opens the reply. A reply ends with the builders' ``<|im_end|>`` (LLaVA's
# own ends with ``</s>``, its tokenizer's end of sequence).
_LLAVA15_MEDIA = "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
_LLAVA_NEXT_VIDEO_MEDIA = "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>\\n' }}{% endfor %}"
LLAVA15_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}"
    f"{_LLAVA15_MEDIA}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] }}{% if not loop.last %}{{ ' ' }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' if message['role'] == 'assistant' else ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# InternVL3/3.5's (the hub's ``-hf`` checkpoints'), without the default system prompt: each picture or video is
# its processor's placeholder on a line of its own, before the text.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma 3's turn layout (each picture its ``<start_of_image>`` before the text) with the builders' chat tokens: the
# fixtures' tokenizers share ``<|im_start|>``/``<|im_end|>`` (the end of a reply) across families.
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>model\\n' }}{% endif %}"
)

MISTRAL3_SPECIAL_TOKENS = (
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
# Mistral's instruct turns ([INST] ... [/INST], then the reply), each picture its [IMG] where it stands, with the
# builders' end of a reply (<|im_end|>).
MISTRAL3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' }}{% elif message['role'] == 'user' %}{{ '[INST]' }}"
    "{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '[IMG]' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[/SYSTEM_PROMPT]' }}{% elif message['role'] == 'user' %}{{ '[/INST]' }}"
    "{% else %}{{ '<|im_end|>' }}{% endif %}"
    "{% endfor %}"
)

GLM_V_SPECIAL_TOKENS = (
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
)
# GLM-4.xV's media markers (each picture <|begin_of_image|><|image|><|end_of_image|>, each video
# <|begin_of_video|><|video|><|end_of_video|>, which its processor expands) in the builders' turns.
GLM_V_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% elif content['type'] == 'video' %}{{ '<|begin_of_video|><|video|><|end_of_video|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CHAT_TEMPLATES = {
    "qwen2_vl": QWEN_CHAT_TEMPLATE,
    "qwen2_5_vl": QWEN_CHAT_TEMPLATE,
    "qwen3_vl": QWEN3_CHAT_TEMPLATE,
    "qwen3_vl_moe": QWEN3_CHAT_TEMPLATE,
    "llava_onevision": LLAVA_CHAT_TEMPLATE,
    "internvl": INTERNVL_CHAT_TEMPLATE,
    "gemma3": GEMMA3_CHAT_TEMPLATE,
    "llava": LLAVA15_CHAT_TEMPLATE,
    "llava_next": LLAVA15_CHAT_TEMPLATE,  # LLaVA-NeXT-Vicuna's is LLaVA-1.5's
    # LLaVA-NeXT-Video's: LLaVA-1.5's with each video a <video> line after the pictures'
    "llava_next_video": LLAVA15_CHAT_TEMPLATE.replace(
        _LLAVA15_MEDIA, _LLAVA15_MEDIA + _LLAVA_NEXT_VIDEO_MEDIA
    ),
    "mistral3": MISTRAL3_CHAT_TEMPLATE,
    "glm46v": GLM_V_CHAT_TEMPLATE,
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of one model (language model + vision tower).

    Attributes:
        hidden: Language-model width (a multiple of ``head_dim``).
        layers: Decoder layers.
        kv_heads: Key/value heads (grouped-query attention; divides ``hidden // head_dim``).
        intermediate: MLP width.
        vision_hidden: Vision-tower width (a multiple of ``vision_heads``).
        vision_layers: Vision-tower layers.
        vision_heads: Vision-tower attention heads.
        head_dim: Language-model attention head width (16, 32 or 64).
        init_std: Standard deviation of the language model's initial weights.
        sliding_window: Gemma 3: the local layers' attention window in tokens.
    """

    hidden: int
    layers: int
    kv_heads: int
    intermediate: int
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    head_dim: int = 32
    init_std: float = 0.02
    sliding_window: int = 1024

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class VisionLayout:
    """Pixel geometry of a family's pictures, shared by its processor and its config.

    Attributes:
        patch: Side of a vision-transformer patch in pixels.
        image_pixels: Qwen families: ``(min, max)`` pixels of a resized image.
        video_pixels: Qwen families: ``(min, max)`` pixels of a resized video frame.
        crop_side: LLaVA-OneVision and InternVL: side of a crop (a tile; the vision tower's input) in pixels.
        anyres_tiles: LLaVA-OneVision: tiles per axis of the anyres grid pinpoints.
        max_tiles: InternVL: the most tiles a picture is cut into (a thumbnail of the whole picture is added when
            it is cut into several).
    """

    patch: int
    image_pixels: tuple[int, int] = (0, 0)
    video_pixels: tuple[int, int] = (0, 0)
    crop_side: int = 0
    anyres_tiles: tuple[int, ...] = (1,)
    max_tiles: int = 1

    def pinpoints(self) -> list[list[int]]:
        """LLaVA-OneVision's ``image_grid_pinpoints``: every ``tiles x tiles`` grid of crops."""
        side = self.crop_side
        return [[side * i, side * j] for i in self.anyres_tiles for j in self.anyres_tiles]


def _transformers_class(family: str, which: int) -> Any:
    import transformers

    return getattr(transformers, _CLASS_NAMES[family][which])


def model_class(family: str) -> type[PreTrainedModel]:
    """The family's ``*ForConditionalGeneration`` class."""
    return _transformers_class(family, 1)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def special_tokens(family: str, grounding: bool) -> tuple[str, ...]:
    """The family's special tokens in vocabulary order (Qwen: with the grounding tokens or without)."""
    if family == "llava_onevision":
        return LLAVA_SPECIAL_TOKENS
    if family == "internvl":
        return (*CHAT_TOKENS, *INTERNVL_NAMED_TOKENS.values())
    if family == "gemma3":
        return (*CHAT_TOKENS, *GEMMA3_NAMED_TOKENS.values())
    if family in ("llava", "llava_next"):
        return (*CHAT_TOKENS, "<image>")
    if family == "llava_next_video":
        return LLAVA_SPECIAL_TOKENS
    if family == "mistral3":
        return (*CHAT_TOKENS, *MISTRAL3_SPECIAL_TOKENS)
    if family == "glm46v":
        return (*CHAT_TOKENS, *GLM_V_SPECIAL_TOKENS)
    if family in _TILE_FAMILIES:
        grid = range(1, _SMOLVLM_GRID + 1)
        return (
            *CHAT_TOKENS,
            *SMOLVLM_NAMED_TOKENS.values(),
            *(f"<row_{r}_col_{c}>" for r in grid for c in grid),
        )
    return (*CHAT_TOKENS, *(_GROUNDING_TOKENS if grounding else ()), *_QWEN_VISION_TOKENS)


def special_token_ids(tokenizer: Qwen2Tokenizer, specials: tuple[str, ...]) -> dict[str, int]:
    """Ids of ``specials`` plus ``"eos"`` (``<|im_end|>``) and ``"pad"`` (``<|endoftext|>``)."""
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in specials}
    ids["eos"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids["pad"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return ids


def byte_level_tokenizer(
    lines: list[str],
    specials: tuple[str, ...],
    chat_template: str,
    vocab_size: int,
    model_max_length: int,
    named: dict[str, str] | None = None,
) -> Qwen2Tokenizer:
    """Trains a byte-level BPE on ``lines`` and wraps it in ``Qwen2Tokenizer`` (the class all six families use).

    Args:
        lines: Training text, one line per item.
        specials: The family's special tokens, appended after the BPE vocabulary.
        chat_template: The family's chat template.
        vocab_size: BPE vocabulary limit (merges stop earlier once nothing is left to merge).
        model_max_length: The tokenizer's ``model_max_length``.
        named: Special tokens the tokenizer also names (``{attribute: token}``, e.g. InternVL's
            ``context_image_token``), saved with it as a checkpoint's tokenizer names them.

    Returns:
        The tokenizer; ``eos_token`` is ``<|im_end|>`` (end of a reply), ``pad_token`` ``<|endoftext|>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(lines, trainer=trainer)
    model_json = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model_json["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=model_json["vocab"],
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        padding_side="left",
        model_specific_special_tokens=named,
    )
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [AddedToken(t, special=True, normalized=False) for t in specials]}
    )
    # Re-register eos/pad now that both exist as added tokens with their final ids (eos stays <|endoftext|> for a
    # tokenizer without <|im_end|>: setting it would add the token).
    if "<|im_end|>" in specials:
        tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = chat_template
    return tokenizer


def chat_template(family: str) -> str:
    """The family's chat template: SmolVLM2's own (transformers' ``DEFAULT_CHAT_TEMPLATE``, which its processor takes
    for every chat with a video whatever its own; SmolVLM 1's, Idefics3's, is the same without videos), the others'
    written here."""
    if family in _TILE_FAMILIES:
        from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

        return DEFAULT_CHAT_TEMPLATE
    return _CHAT_TEMPLATES[family]


def build_tokenizer(
    family: str, lines: list[str], *, grounding: bool, vocab_size: int, model_max_length: int
) -> Qwen2Tokenizer:
    """:func:`byte_level_tokenizer` with the family's :func:`special_tokens` and chat template."""
    return byte_level_tokenizer(
        lines=lines,
        specials=special_tokens(family, grounding),
        chat_template=chat_template(family),
        vocab_size=vocab_size,
        model_max_length=model_max_length,
        named={
            "internvl": INTERNVL_NAMED_TOKENS,
            "gemma3": GEMMA3_NAMED_TOKENS,
            "smolvlm": SMOLVLM_NAMED_TOKENS,
            "idefics3": SMOLVLM_NAMED_TOKENS,
        }.get(family),
    )


# ---------------------------------------------------------------------------------------------
# Processor
# ---------------------------------------------------------------------------------------------
def build_processor(family: str, tokenizer: Qwen2Tokenizer, layout: VisionLayout) -> ProcessorMixin:
    """Builds the family's real processor class around ``tokenizer`` with ``layout``'s geometry.

    Returns:
        A ``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``, ``LlavaOnevisionProcessor`` or
        ``InternVLProcessor`` with the tokenizer's chat template.
    """
    processor_cls = _transformers_class(family, 2)
    if family in _TILE_FAMILIES:
        import transformers

        tile = {"longest_edge": layout.crop_side}
        image_processor = getattr(
            transformers, "SmolVLMImageProcessor" if family == "smolvlm" else "Idefics3ImageProcessor"
        )
        videos = {}
        if family == "smolvlm":  # a frame: one tile
            videos["video_processor"] = transformers.SmolVLMVideoProcessor(
                size=tile, max_image_size=tile, do_sample_frames=False
            )
        return processor_cls(  # a picture resized to at most a grid of tiles and cut into them
            image_processor=image_processor(
                do_image_splitting=True,
                size={"longest_edge": _SMOLVLM_GRID * layout.crop_side},
                max_image_size=tile,
            ),
            tokenizer=tokenizer,
            image_seq_len=_pooled_tokens_per_crop(layout),
            chat_template=tokenizer.chat_template,
            **videos,
        )
    if family == "glm46v":
        from transformers import Glm46VImageProcessor, Glm46VVideoProcessor

        geometry = {"patch_size": layout.patch, "temporal_patch_size": 2, "merge_size": 2}
        return processor_cls(  # Qwen2-VL's resizing: whole merged patches within the pixel ranges
            image_processor=Glm46VImageProcessor(size=_pixel_range(layout.image_pixels), **geometry),
            tokenizer=tokenizer,
            video_processor=Glm46VVideoProcessor(
                size=_pixel_range(layout.video_pixels),
                max_image_size={"longest_edge": layout.video_pixels[1]},
                do_sample_frames=False,
                **geometry,
            ),
            chat_template=tokenizer.chat_template,
        )
    if family == "mistral3":
        from transformers import PixtralImageProcessor

        return processor_cls(  # a picture resized to whole merged patches, its longest side at most crop_side
            image_processor=PixtralImageProcessor(size={"longest_edge": layout.crop_side}),
            tokenizer=tokenizer,
            patch_size=layout.patch,
            spatial_merge_size=_MISTRAL3_MERGE,
            chat_template=tokenizer.chat_template,
        )
    if family in _LLAVA15_FAMILIES:
        from transformers import CLIPImageProcessor, LlavaNextImageProcessor, LlavaNextVideoVideoProcessor

        side = layout.crop_side
        crops = {"size": {"shortest_edge": side}, "crop_size": {"height": side, "width": side}}
        videos = (
            {"video_processor": LlavaNextVideoVideoProcessor(**crops)} if family == "llava_next_video" else {}
        )
        return processor_cls(  # CLIP's CLS token goes ("default" strategy): one token per patch
            image_processor=CLIPImageProcessor(**crops)
            if family == "llava"
            else LlavaNextImageProcessor(**crops, image_grid_pinpoints=layout.pinpoints()),
            **videos,
            tokenizer=tokenizer,
            patch_size=layout.patch,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=tokenizer.chat_template,
        )
    if family == "gemma3":
        from transformers import Gemma3ImageProcessor

        side = {"height": layout.crop_side, "width": layout.crop_side}
        return processor_cls(
            image_processor=Gemma3ImageProcessor(size=side),
            tokenizer=tokenizer,
            image_seq_length=_pooled_tokens_per_crop(layout),
            chat_template=tokenizer.chat_template,
        )
    if family == "internvl":
        from transformers import GotOcr2ImageProcessor, InternVLVideoProcessor

        side = {"height": layout.crop_side, "width": layout.crop_side}
        return processor_cls(
            image_processor=GotOcr2ImageProcessor(
                size=side, crop_to_patches=True, max_patches=layout.max_tiles
            ),
            tokenizer=tokenizer,
            video_processor=InternVLVideoProcessor(size=side, do_sample_frames=False),
            image_seq_length=_pooled_tokens_per_crop(layout),
            chat_template=tokenizer.chat_template,
        )
    if family == "llava_onevision":
        from transformers import LlavaOnevisionImageProcessor, LlavaOnevisionVideoProcessor

        side = layout.crop_side
        return processor_cls(
            image_processor=LlavaOnevisionImageProcessor(
                size={"height": side, "width": side}, image_grid_pinpoints=layout.pinpoints()
            ),
            tokenizer=tokenizer,
            video_processor=LlavaOnevisionVideoProcessor(
                size={"height": side, "width": side}, do_sample_frames=False
            ),
            num_image_tokens=(side // layout.patch) ** 2,
            vision_feature_select_strategy="full",
            chat_template=tokenizer.chat_template,
            vision_aspect_ratio="anyres_max_9",
        )
    from transformers import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor

    geometry: dict[str, Any] = {"patch_size": layout.patch, "temporal_patch_size": 2, "merge_size": 2}
    qwen3 = family in QWEN3_FAMILIES
    normalisation = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]} if qwen3 else {}
    video_cls = Qwen3VLVideoProcessor if qwen3 else Qwen2VLVideoProcessor
    return processor_cls(
        image_processor=Qwen2VLImageProcessor(
            size=_pixel_range(layout.image_pixels), **geometry, **normalisation
        ),
        tokenizer=tokenizer,
        video_processor=video_cls(
            size=_pixel_range(layout.video_pixels),
            **geometry,
            min_frames=2,
            max_frames=16,
            do_sample_frames=False,
            cap_pixels_per_frame=False,
        ),
        chat_template=tokenizer.chat_template,
    )


def _pooled_tokens_per_crop(layout: VisionLayout) -> int:
    """Visual tokens of one crop (an InternVL tile, a Gemma 3 picture): its patches, 2 x 2 of them merged into one
    (InternVL's pixel shuffle; Gemma 3's average pool, which takes the real model's 64 x 64 patches to 16 x 16)."""
    return (layout.crop_side // layout.patch) ** 2 // 4


def _pixel_range(pixels: tuple[int, int]) -> dict[str, int]:
    return {"shortest_edge": pixels[0], "longest_edge": pixels[1]}


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------
def build_config(
    family: str,
    spec: ModelSpec,
    tokenizer: Qwen2Tokenizer,
    layout: VisionLayout,
    *,
    explicit_head_dim: bool = True,
) -> Any:
    """Builds the family's real config class for ``spec``.

    Args:
        family: One of :data:`FAMILIES` or :data:`MOE_FAMILIES`.
        spec: The model's shape.
        tokenizer: The pair's tokenizer (vocabulary size and special-token ids).
        layout: The processor's geometry (patch size; LLaVA-OneVision's crop side and pinpoints).
        explicit_head_dim: Whether the text config names ``head_dim`` (Qwen3-VL's always does); when not,
            transformers derives it as ``hidden // heads``.

    Returns:
        A ``Qwen2VLConfig``, ``Qwen2_5_VLConfig``, ``Qwen3VLConfig``, ``Qwen3VLMoeConfig``,
        ``LlavaOnevisionConfig`` or ``InternVLConfig``.
    """
    tid = tokenizer.convert_tokens_to_ids
    text: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.hidden // spec.head_dim,
        **({"head_dim": spec.head_dim} if explicit_head_dim or family in QWEN3_FAMILIES else {}),
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": 4096,
        "initializer_range": spec.init_std,
        "pad_token_id": tid("<|endoftext|>"),
        "eos_token_id": tid("<|im_end|>"),
        "bos_token_id": tid("<|endoftext|>"),
    }
    if family in MOE_FAMILIES:  # every layer sparse, experts half the dense width each
        text |= {"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_EXPERTS_PER_TOKEN}
        text |= {
            "moe_intermediate_size": spec.intermediate // 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    config_cls = _transformers_class(family, 0)
    if family == "llava_onevision":
        return config_cls(**_llava_config_kwargs(spec, text, tid, layout))
    if family == "internvl":
        return config_cls(**_internvl_config_kwargs(spec, text, tid, layout))
    if family == "gemma3":
        return config_cls(**_gemma3_config_kwargs(spec, text, tid, layout))
    if family in _LLAVA15_FAMILIES:
        return config_cls(**_llava15_config_kwargs(family, spec, text, tid, layout))
    if family == "mistral3":
        return config_cls(**_mistral3_config_kwargs(spec, text, tid, layout))
    if family == "glm46v":
        return config_cls(**_glm_v_config_kwargs(spec, text, tid, layout))
    if family in _TILE_FAMILIES:
        return config_cls(
            text_config={**text, "model_type": "llama"},
            vision_config=_vision_tower(spec, layout),
            scale_factor=2,  # 2 x 2 patches shuffled into one token (the real models: 4 x 4)
            image_token_id=tid(SMOLVLM_NAMED_TOKENS["image_token"]),
            pad_token_id=text["pad_token_id"],
            tie_word_embeddings=False,
        )
    return config_cls(
        text_config={**text, "rope_parameters": _mrope(family, spec.head_dim)},
        vision_config={
            "depth": spec.vision_layers,
            "num_heads": spec.vision_heads,
            "patch_size": layout.patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": _VISION_INIT_STD,
            **_qwen_vision_widths(family, spec),
        },
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_token_id=tid("<|vision_start|>"),
        vision_end_token_id=tid("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def _llava_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``LlavaOnevisionConfig``'s arguments: a Qwen2 language model behind a SigLIP tower (no head)."""
    return {
        "text_config": {
            **text,
            "model_type": "qwen2",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "vision_config": _siglip_config(spec, layout),
        "image_token_index": tid("<image>"),
        "video_token_index": tid("<video>"),
        "vision_feature_select_strategy": "full",
        "vision_feature_layer": -1,
        "image_grid_pinpoints": layout.pinpoints(),
        "vision_aspect_ratio": "anyres_max_9",
        "tie_word_embeddings": False,
    }


def _llava15_config_kwargs(
    family: str, spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``LlavaConfig``'s arguments, LLaVA-1.5's: a Llama language model behind a CLIP tower whose second-to-last
    layer's patch features (CLS dropped) go through a two-layer projector, one token per patch; ``LlavaNextConfig``'s
    the same with the anyres grids (``layout``'s pinpoints); ``LlavaNextVideoConfig``'s with a video's frames'
    patches average-pooled 2 x 2."""
    extra = {} if family == "llava" else {"image_grid_pinpoints": layout.pinpoints()}
    if family == "llava_next_video":
        extra |= {
            "video_token_index": tid("<video>"),
            "spatial_pool_mode": "average",
            "spatial_pool_stride": 2,
        }
    return {
        **extra,
        "text_config": {
            **text,
            "model_type": "llama",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "vision_config": _vision_tower(spec, layout, model_type="clip_vision_model"),
        "image_token_index": tid("<image>"),
        "image_seq_length": (layout.crop_side // layout.patch) ** 2,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "tie_word_embeddings": False,
    }


def _mistral3_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Mistral3Config``'s arguments, Ministral 3's: a Pixtral tower reading pictures of up to ``crop_side`` pixels,
    2 x 2 patches merged into one token, and a Ministral 3 language model whose YaRN RoPE starts from 32 positions, so
    that its queries' scale (Llama 4's, which grows past ``original_max_position_embeddings``) changes within a reply."""
    rope = {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 128.0,  # max_position_embeddings / original_max_position_embeddings
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "llama_4_scaling_beta": 0.1,
    }
    return {
        "text_config": {  # Ministral 3's head_dim defaults to 128, not hidden // heads
            **text,
            "model_type": "ministral3",
            "head_dim": spec.head_dim,
            "rope_parameters": rope,
            "sliding_window": None,
        },
        "vision_config": _vision_tower(spec, layout, model_type="pixtral"),
        "image_token_index": tid("[IMG]"),
        "spatial_merge_size": _MISTRAL3_MERGE,
        "vision_feature_layer": -1,
        "tie_word_embeddings": False,
    }


def _glm_v_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Glm46VConfig``'s arguments, GLM-4.6V-Flash's: a ViT of ``patch`` pixels, 2 x 2 patches merged, in front of a
    GLM-4 language model whose M-RoPE turns half of each head, as GLM's does (``partial_rotary_factor`` 0.5)."""
    half = spec.head_dim // 4  # rotary pairs: half the head turns
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [half // 2, half // 4, half - half // 2 - half // 4],
    }
    return {
        "text_config": {**text, "model_type": "glm4v_text", "rope_parameters": rope},
        "vision_config": {
            "depth": spec.vision_layers,
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_heads": spec.vision_heads,
            "out_hidden_size": spec.hidden,
            "patch_size": layout.patch,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "image_size": 4
            * layout.patch,  # its learnt position table: 4 x 4 patches, interpolated to each grid
            "initializer_range": _VISION_INIT_STD,
        },
        "image_token_id": tid("<|image|>"),
        "video_token_id": tid("<|video|>"),
        "image_start_token_id": tid("<|begin_of_image|>"),
        "image_end_token_id": tid("<|end_of_image|>"),
        "video_start_token_id": tid("<|begin_of_video|>"),
        "video_end_token_id": tid("<|end_of_video|>"),
        "tie_word_embeddings": False,
    }


def _siglip_config(spec: ModelSpec, layout: VisionLayout) -> dict[str, Any]:
    """A SigLIP vision tower's config (LLaVA-OneVision's and Gemma 3's): crops of ``crop_side`` pixels, no head."""
    return _vision_tower(spec, layout, model_type="siglip_vision_model", vision_use_head=False)


def _vision_tower(spec: ModelSpec, layout: VisionLayout, **extra: Any) -> dict[str, Any]:
    """A ViT tower's config (SigLIP, CLIP, SmolVLM's): ``spec``'s widths, crops of ``crop_side`` pixels."""
    return {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": 2 * spec.vision_hidden,
        "num_hidden_layers": spec.vision_layers,
        "num_attention_heads": spec.vision_heads,
        "image_size": layout.crop_side,
        "patch_size": layout.patch,
        **extra,
    }


def _internvl_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``InternVLConfig``'s arguments: a Qwen2 language model behind an InternViT tower, whose patch features are
    pixel-shuffled (2 x 2 into one) and projected (InternVL3's; InternVL3.5's language model is Qwen3)."""
    return {
        "text_config": {
            **text,
            "model_type": "qwen2",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "vision_config": {
            "hidden_size": spec.vision_hidden,
            "intermediate_size": 2 * spec.vision_hidden,
            "num_hidden_layers": spec.vision_layers,
            "num_attention_heads": spec.vision_heads,
            "image_size": [layout.crop_side, layout.crop_side],
            "patch_size": [layout.patch, layout.patch],
            "initializer_range": _VISION_INIT_STD,
            # InternViT scales each block's output by a learned factor, 0.1 at init; a random tower's blocks would
            # then barely touch the patch embeddings and every picture would look alike to the language model.
            "layer_scale_init_value": 1.0,
        },
        "image_token_id": tid(INTERNVL_NAMED_TOKENS["context_image_token"]),
        "image_seq_length": _pooled_tokens_per_crop(layout),
        "downsample_ratio": 0.5,
        "tie_word_embeddings": False,
    }


def _gemma3_config_kwargs(
    spec: ModelSpec, text: dict[str, Any], tid: Callable[[str], int], layout: VisionLayout
) -> dict[str, Any]:
    """``Gemma3Config``'s arguments: a Gemma 3 language model (local sliding-window layers, the last layer global,
    as the real models interleave five local layers per global one) behind a SigLIP tower whose patches are
    average-pooled and projected, the local layers' window :attr:`ModelSpec.sliding_window` tokens."""
    layer_types = ["sliding_attention"] * (spec.layers - 1) + ["full_attention"]
    return {
        "text_config": {
            **text,
            "head_dim": spec.head_dim,
            "query_pre_attn_scalar": spec.head_dim,
            "sliding_window": spec.sliding_window,
            "layer_types": layer_types,
        },
        "vision_config": _siglip_config(spec, layout),
        "mm_tokens_per_image": _pooled_tokens_per_crop(layout),
        "boi_token_index": tid(GEMMA3_NAMED_TOKENS["boi_token"]),
        "eoi_token_index": tid(GEMMA3_NAMED_TOKENS["eoi_token"]),
        "image_token_index": tid(GEMMA3_NAMED_TOKENS["image_token"]),
        "tie_word_embeddings": False,
    }


def _mrope(family: str, head_dim: int) -> dict[str, Any]:
    """The Qwen family's multimodal rotary settings (Qwen3-VL interleaves the sections)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if family in QWEN3_FAMILIES:
        return {**rope, "mrope_section": _QWEN3_MROPE_SECTIONS[head_dim], "mrope_interleaved": True}
    return {**rope, "mrope_section": _MROPE_SECTIONS[head_dim]}


def _qwen_vision_widths(family: str, spec: ModelSpec) -> dict[str, Any]:
    """The vision-config entries each Qwen family names its own way (widths, windows, deepstack)."""
    if family == "qwen2_vl":
        return {"embed_dim": spec.vision_hidden, "hidden_size": spec.hidden, "mlp_ratio": 2}
    widths = {
        "hidden_size": spec.vision_hidden,
        "intermediate_size": 2 * spec.vision_hidden,
        "out_hidden_size": spec.hidden,
    }
    if family == "qwen2_5_vl":
        return {
            **widths,
            "window_size": 56,
            "fullatt_block_indexes": [spec.vision_layers - 1],
            "tokens_per_second": 2,
        }
    return {**widths, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}


def generation_config(tokenizer: Qwen2Tokenizer) -> GenerationConfig:
    """Greedy generation that stops at ``<|im_end|>`` (or ``<|endoftext|>``)."""
    from transformers import GenerationConfig

    ids = special_token_ids(tokenizer, ())
    return GenerationConfig(
        eos_token_id=[ids["eos"], ids["pad"]],
        pad_token_id=ids["pad"],
        bos_token_id=ids["pad"],
        do_sample=False,
    )
