"""The families' special tokens, chat templates and byte-level tokenizers."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

from .specs import INTERNVL_FAMILIES, LFM2_VL_GRID, MINICPMV_FAMILIES, TILE_FAMILIES

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
GEMMA4_NAMED_TOKENS = {
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "image_token": "<|image|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "audio_token": "<|audio|>",
}
"""Gemma 4's named special tokens (its processor reads them all, the audio ones too): a picture is written
``<|image|>`` in the text, which the processor expands to ``<|image>`` + one ``<|image|>`` per visual token +
``<image|>``; a video is written ``<|video|>`` (an added token, :data:`GEMMA4_SPECIAL_TOKENS`), each frame expanded
to its time and ``<|image>`` + one ``<|video|>`` per visual token + ``<image|>``."""
GEMMA4_SPECIAL_TOKENS = (*GEMMA4_NAMED_TOKENS.values(), "<|video|>")
JANUS_NAMED_TOKENS = {
    "image_token": "<image_placeholder>",
    "boi_token": "<begin_of_image>",
    "eoi_token": "<end_of_image>",
}
"""Janus's named special tokens: a picture is written ``<image_placeholder>`` in the text, which the processor expands
to ``<begin_of_image>`` + one ``<image_placeholder>`` per visual token + ``<end_of_image>``."""
AYA_VISION_SPECIAL_TOKENS = (
    "<image>",
    "<|START_OF_IMG|>",
    "<|END_OF_IMG|>",
    "<|IMG_PATCH|>",
    "<|IMG_LINE_BREAK|>",
    "TILE",
    "TILE_GLOBAL",
)
"""Aya Vision's special tokens: a picture is written ``<image>`` in the text, which the processor expands to
``<|START_OF_IMG|>``, each tile's ``TILE_i`` + one ``<|IMG_PATCH|>`` per visual token, the whole picture's
``TILE_GLOBAL`` + its tokens, and ``<|END_OF_IMG|>``."""
OVIS2_INDICATOR_TOKENS = ("<IMG_START>", "<IMG_GRID>", "<IMG_COL>", "<IMG_ROW>", "<IMG_END>")
"""Ovis2's visual indicator tokens, in the order of the model's ``visual_indicator_token_ids``: the processor writes a
picture as ``<IMG_START>``, the whole picture's ``<IMG_ATOM>`` tokens, ``<IMG_GRID>``, then (when it is cut into
several tiles) each tile's, ``<IMG_COL>`` between the tiles of a row and ``<IMG_ROW>`` between rows, and
``<IMG_END>``; the model embeds each indicator with its own row of the visual embedding table."""
OVIS2_SPECIAL_TOKENS = ("<image>", "<IMG_ATOM>", *OVIS2_INDICATOR_TOKENS)
SMOLVLM_NAMED_TOKENS = {
    "fake_image_token": "<fake_token_around_image>",
    "image_token": "<image>",
    "end_of_utterance_token": "<end_of_utterance>",
    "global_image_token": "<global-img>",
}
"""SmolVLM's named special tokens: a picture is written ``<image>`` in the text, which the processor expands to each
tile's ``<fake_token_around_image><row_r_col_c>`` + ``<image>`` per visual token, then the whole picture's
``<global-img>`` tile; a turn ends with ``<end_of_utterance>``."""
PERCEPTION_LM_NAMED_TOKENS = {"image_token": "<|image|>", "video_token": "<|video|>"}
"""Perception LM's named special tokens: a picture is written ``<|image|>`` in the text, which the processor expands
to one ``<|image|>`` per visual token of every tile; a video ``<|video|>``, one per token of every frame."""
LFM2_VL_NAMED_TOKENS = {
    "image_token": "<image>",
    "image_start_token": "<|image_start|>",
    "image_end_token": "<|image_end|>",
    "image_thumbnail_token": "<|img_thumbnail|>",
}
"""LFM2-VL's named special tokens: a picture is written ``<image>`` in the text, which the processor expands to
``<|image_start|>``, each tile's ``<|img_row_r_col_c|>`` + one ``<image>`` per visual token, the thumbnail's
``<|img_thumbnail|>`` + its tokens (a picture small enough for one tile: its tokens alone), and ``<|image_end|>``."""
MINICPMV_NAMED_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
"""MiniCPM-V 4.6's and 4.7's named special tokens: a picture is written ``<|image_pad|>`` in the text, which the processor
expands to ``<image_id>i</image_id><image>`` + one ``<|image_pad|>`` per visual token of the whole picture +
``</image>``, then each slice's ``<slice>`` + its tokens + ``</slice>``; a video ``<|video_pad|>``, each frame in
``<image>`` tags."""
SMOLVLM_GRID = 2
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

# Gemma 4's turn layout (each medium its placeholder in place, ``model`` the assistant's role) with the builders' chat
# tokens, not Gemma 4's own turn tokens
GEMMA4_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("'<start_of_image>'", "'<|image|>'").replace(
    "{% elif content['type'] == 'text' %}",
    "{% elif content['type'] == 'video' %}{{ '<|video|>' }}{% elif content['type'] == 'text' %}",
)

# Aya Vision's turn layout (the pictures, then the text) with the builders' chat tokens, not Cohere's turn tokens.
AYA_VISION_CHAT_TEMPLATE = GEMMA3_CHAT_TEMPLATE.replace("<start_of_image>", "<image>").replace(
    "model", "assistant"
)

# FastVLM's (transformers' conversion of Apple's FastVLM): a ChatML turn, a default system turn first, the turn's
# pictures as <image> placeholders, then each text on a new line, in Qwen2's ChatML
FAST_VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' + content['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
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

# Ovis2's turn layout is Aya Vision's (a ChatML turn, its pictures first), in Qwen2.5's ChatML, its language model's
OVIS2_CHAT_TEMPLATE = AYA_VISION_CHAT_TEMPLATE
# Janus's: the same layout, a picture written as its placeholder (the processor frames and repeats it)
JANUS_CHAT_TEMPLATE = AYA_VISION_CHAT_TEMPLATE.replace("<image>", JANUS_NAMED_TOKENS["image_token"])

# VideoLLaMA3's (transformers' conversions): ChatML, each medium its placeholder on a line of its own before the text;
# the processor writes a picture's placeholder once per patch and a video's as "Time t s:" + each frame's tokens
VIDEO_LLAMA3_CHAT_TEMPLATE = GLM_V_CHAT_TEMPLATE.replace(
    "<|begin_of_image|><|image|><|end_of_image|>", "<|image_pad|>\\n"
).replace("<|begin_of_video|><|video|><|end_of_video|>", "<|video_pad|>\\n")

# Perception LM's (facebook/Perception-LM-*'s, without its default system prompt): Llama 3's turn headers (here the
# builders' <|im_start|> role, a blank line) and ends (<|im_end|>), each turn's pictures, then its videos, then its text
PERCEPTION_LM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<|image|>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<|video|>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] | trim }}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}"
)

# LFM2-VL's: ChatML turns (<|im_start|>role, the text with each picture's <image> where it stands, <|im_end|>), as
# Aya Vision's fixture template writes them
LFM2_VL_CHAT_TEMPLATE = AYA_VISION_CHAT_TEMPLATE

# MiniCPM-V 4.6's and 4.7's: ChatML turns, each picture's and video's placeholder where it stands
MINICPMV_CHAT_TEMPLATE = (
    GEMMA4_CHAT_TEMPLATE.replace("<|image|>", "<|image_pad|>")
    .replace("<|video|>", "<|video_pad|>")
    .replace("model", "assistant")
)

_CHAT_TEMPLATES = {
    "qwen2_vl": QWEN_CHAT_TEMPLATE,
    "qwen2_5_vl": QWEN_CHAT_TEMPLATE,
    "qwen3_vl": QWEN3_CHAT_TEMPLATE,
    "qwen3_vl_moe": QWEN3_CHAT_TEMPLATE,
    "qwen3_5": QWEN3_CHAT_TEMPLATE,
    "llava_onevision": LLAVA_CHAT_TEMPLATE,
    "internvl": INTERNVL_CHAT_TEMPLATE,
    "internvl_moe": INTERNVL_CHAT_TEMPLATE,
    "gemma3": GEMMA3_CHAT_TEMPLATE,
    "gemma4": GEMMA4_CHAT_TEMPLATE,
    "llava": LLAVA15_CHAT_TEMPLATE,
    "llava_next": LLAVA15_CHAT_TEMPLATE,  # LLaVA-NeXT-Vicuna's is LLaVA-1.5's
    # LLaVA-NeXT-Video's: LLaVA-1.5's with each video a <video> line after the pictures'
    "llava_next_video": LLAVA15_CHAT_TEMPLATE.replace(
        _LLAVA15_MEDIA, _LLAVA15_MEDIA + _LLAVA_NEXT_VIDEO_MEDIA
    ),
    "mistral3": MISTRAL3_CHAT_TEMPLATE,
    "glm46v": GLM_V_CHAT_TEMPLATE,
    "aya_vision": AYA_VISION_CHAT_TEMPLATE,
    "ovis2": OVIS2_CHAT_TEMPLATE,
    "janus": JANUS_CHAT_TEMPLATE,
    "deepseek_vl": JANUS_CHAT_TEMPLATE,
    "deepseek_vl_hybrid": JANUS_CHAT_TEMPLATE,
    "video_llama_3": VIDEO_LLAMA3_CHAT_TEMPLATE,
    "perception_lm": PERCEPTION_LM_CHAT_TEMPLATE,
    "lfm2_vl": LFM2_VL_CHAT_TEMPLATE,
    # LFM3-VL's processor writes a video's frames as Qwen3-VL's does (each frame's time, then its tokens)
    "lfm3_vl": QWEN3_CHAT_TEMPLATE,
    "minicpmv4_6": MINICPMV_CHAT_TEMPLATE,
    "minicpmv4_7": MINICPMV_CHAT_TEMPLATE,
    "fast_vlm": FAST_VLM_CHAT_TEMPLATE,
}


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------
def special_tokens(family: str, grounding: bool) -> tuple[str, ...]:
    """The family's special tokens in vocabulary order (Qwen: with the grounding tokens or without)."""
    if family == "llava_onevision":
        return LLAVA_SPECIAL_TOKENS
    if family in INTERNVL_FAMILIES:
        return (*CHAT_TOKENS, *INTERNVL_NAMED_TOKENS.values())
    if family == "gemma3":
        return (*CHAT_TOKENS, *GEMMA3_NAMED_TOKENS.values())
    if family == "gemma4":
        return (*CHAT_TOKENS, *GEMMA4_SPECIAL_TOKENS)
    if family in ("llava", "llava_next", "fast_vlm"):
        return (*CHAT_TOKENS, "<image>")
    if family == "llava_next_video":
        return LLAVA_SPECIAL_TOKENS
    if family == "mistral3":
        return (*CHAT_TOKENS, *MISTRAL3_SPECIAL_TOKENS)
    if family == "glm46v":
        return (*CHAT_TOKENS, *GLM_V_SPECIAL_TOKENS)
    if family == "aya_vision":
        return (*CHAT_TOKENS, *AYA_VISION_SPECIAL_TOKENS)
    if family == "ovis2":
        return (*CHAT_TOKENS, *OVIS2_SPECIAL_TOKENS)
    if family == "janus":
        return (*CHAT_TOKENS, *JANUS_NAMED_TOKENS.values())
    if family in ("deepseek_vl", "deepseek_vl_hybrid"):  # one tokenizer: the 1.3B's type drafts for the 7B's
        return (*CHAT_TOKENS, JANUS_NAMED_TOKENS["image_token"])
    if family == "perception_lm":
        return (*CHAT_TOKENS, *PERCEPTION_LM_NAMED_TOKENS.values())
    if family in MINICPMV_FAMILIES:
        return (*CHAT_TOKENS, *MINICPMV_NAMED_TOKENS.values())
    if family == "lfm2_vl":
        grid = range(1, LFM2_VL_GRID + 1)
        tiles = (f"<|img_row_{r}_col_{c}|>" for r in grid for c in grid)
        return (*CHAT_TOKENS, *LFM2_VL_NAMED_TOKENS.values(), *tiles)
    if family in TILE_FAMILIES:
        grid = range(1, SMOLVLM_GRID + 1)
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
    if family in TILE_FAMILIES:
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
            "internvl_moe": INTERNVL_NAMED_TOKENS,
            "gemma3": GEMMA3_NAMED_TOKENS,
            "gemma4": GEMMA4_NAMED_TOKENS,
            "janus": JANUS_NAMED_TOKENS,
            "deepseek_vl": {"image_token": JANUS_NAMED_TOKENS["image_token"]},
            "deepseek_vl_hybrid": {"image_token": JANUS_NAMED_TOKENS["image_token"]},
            "perception_lm": PERCEPTION_LM_NAMED_TOKENS,
            "lfm2_vl": LFM2_VL_NAMED_TOKENS,
            "minicpmv4_6": MINICPMV_NAMED_TOKENS,
            "minicpmv4_7": MINICPMV_NAMED_TOKENS,
            "smolvlm": SMOLVLM_NAMED_TOKENS,
            "idefics3": SMOLVLM_NAMED_TOKENS,
        }.get(family),
    )
