"""FastVLM (``FastVLM-0.5B`` drafting for ``FastVLM-7B``): the tiny ``fast_vlm`` pair (timm's FastViTHD tower at small
widths, a Qwen2 language model) is lossless like the other families (``test_more_families.py``). Here, its own way:
how many tokens a picture is, as the real processor writes them and the real tower's grid gives them."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AutoProcessor, FastVlmConfig, FastVlmForConditionalGeneration

from vlmspec.family_builders.chat import FAST_VLM_CHAT_TEMPLATE
from vlmspec.models.fast_vlm import FastVlmAdapter
from vlmspec.testing import build_tiny_pair, make_image


def test_a_1024_pixel_picture_is_256_tokens_from_the_processor_and_from_the_tower(tiny_root):
    """The real geometry (the transformers conversions: 1024-pixel pictures, the processor's patch of 64 pixels,
    ``image_seq_length`` 256): the processor writes 256 ``<image>`` placeholders, FastViTHD's stages (the fixture's
    widths, the real model's strides) give a 16 x 16 grid, and the adapter counts one picture."""
    pair = build_tiny_pair("fast_vlm", root=tiny_root)
    processor = AutoProcessor.from_pretrained(pair.target)
    processor.image_processor.size = {"shortest_edge": 1024}
    processor.image_processor.crop_size = {"height": 1024, "width": 1024}
    inputs = processor(text=["<image>\nDescribe it."], images=[make_image(0)], return_tensors="pt")
    model = FastVlmForConditionalGeneration.from_pretrained(pair.target).eval()
    placeholders = int((inputs["input_ids"] == model.config.image_token_id).sum())
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], return_dict=True).pooler_output
    assert placeholders == features.shape[1] == (1024 // 64) ** 2 == 256
    real = FastVlmConfig(  # the conversions' image_seq_length, the fixture's tower and tokens
        vision_config=model.config.vision_config.to_dict(),
        text_config=model.config.text_config.to_dict(),
        image_token_index=model.config.image_token_id,
        image_seq_length=256,
    )
    adapter = FastVlmAdapter(SimpleNamespace(config=real))
    assert adapter.block_tokens == 256 and adapter._blocks(inputs["input_ids"]) == 1


def test_the_chat_template_writes_the_pictures_first_then_the_text():
    """As the conversions' template: a default system turn, the turn's pictures as ``<image>``, then its text on a
    new line."""
    from jinja2 import Template

    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image"}]}]
    prompt = Template(FAST_VLM_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<image>\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    )
