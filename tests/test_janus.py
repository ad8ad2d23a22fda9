"""Janus (``Janus-Pro-1B`` drafting for ``Janus-Pro-7B``) and DeepSeek-VL: the tiny ``janus`` and ``deepseek_vl`` pairs
(a SigLIP tower, an aligner, a Llama language model, and Janus's image-generation parts vlmspec never runs) are
lossless like the other families (``test_more_families.py``). Here, their own ways: a picture's token count as the
real processors write it, and the prompt's frame around a Janus picture, which the draft keeps when it drops visual
tokens (a DeepSeek-VL picture has none)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from transformers import DeepseekVLConfig, DeepseekVLProcessor, JanusConfig, JanusProcessor

from vlmspec import InvalidInputError, VLMSpecPipeline
from vlmspec.family_builders.chat import JANUS_NAMED_TOKENS
from vlmspec.models.janus import DeepseekVLAdapter, JanusAdapter
from vlmspec.testing import build_tiny_pair, make_image


def test_a_picture_holds_the_processor_s_count_of_placeholders():
    """The real geometry (384-pixel pictures of 16-pixel patches): 576 tokens a picture, the count ``JanusProcessor``
    writes by default (``num_image_tokens``)."""
    config = JanusConfig(vision_config={"image_size": 384, "patch_size": 16})
    adapter = JanusAdapter(SimpleNamespace(config=config))
    processor_default = inspect.signature(JanusProcessor.__init__).parameters["num_image_tokens"].default
    assert adapter.block_tokens == (384 // 16) ** 2 == processor_default == 576
    deepseek = DeepseekVLAdapter(SimpleNamespace(config=DeepseekVLConfig(vision_config={"image_size": 384})))
    deepseek_default = inspect.signature(DeepseekVLProcessor.__init__).parameters["num_image_tokens"].default
    assert deepseek.block_tokens == deepseek_default == 576  # SigLIP's 16-pixel patches


def test_a_deepseek_vl_picture_is_its_placeholders_alone(tiny_root):
    """DeepSeek-VL's processor writes a picture as one run of its placeholders; a pruned draft keeps the reply
    ``generate()``'s."""
    pair = build_tiny_pair("deepseek_vl", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    inputs = pipe.prepare_inputs(make_image(1), "Describe the picture.")
    ids, tokenizer = inputs["input_ids"][0], pipe.processor.tokenizer
    placeholder = ids == tokenizer.convert_tokens_to_ids(JANUS_NAMED_TOKENS["image_token"])
    run = placeholder.nonzero()[:, 0]
    assert run.numel() == DeepseekVLAdapter(pipe.target).block_tokens == 4 and (run.diff() == 1).all()
    out = pipe(make_image(1), "Describe the picture.", max_new_tokens=24, prune_ratio=0.5)
    assert out.token_ids == pipe.reference_generate(inputs, max_new_tokens=24)
    assert out.stats.draft_visual_tokens == 2


def test_a_pruned_draft_keeps_each_picture_s_frame(tiny_root):
    """Two pictures: each is ``<begin_of_image>`` + its placeholders + ``<end_of_image>``; the draft pruned by 0.9
    reads fewer placeholders and both frames, and the reply is ``generate()``'s."""
    pair = build_tiny_pair("janus", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    pictures = [make_image(1), make_image(2)]
    inputs = pipe.prepare_inputs(pictures, "Compare the two pictures.")
    ids, tokenizer = inputs["input_ids"][0], pipe.processor.tokenizer
    count = {
        name: int((ids == tokenizer.convert_tokens_to_ids(token)).sum())
        for name, token in JANUS_NAMED_TOKENS.items()
    }
    assert count == {
        "image_token": 2 * JanusAdapter(pipe.target).block_tokens,
        "boi_token": 2,
        "eoi_token": 2,
    }
    out = pipe(pictures, "Compare the two pictures.", max_new_tokens=32, prune_ratio=0.9)
    assert out.token_ids == pipe.reference_generate(inputs, max_new_tokens=32)
    assert out.stats.target_visual_tokens == count["image_token"] > out.stats.draft_visual_tokens > 0


def test_deepseek_vl_1_3b_s_type_drafts_for_the_hybrid_7b_s_and_not_the_other_way_round(tiny_root):
    """The hybrid target reads a picture at both resolutions, each of which changes its features; a ``deepseek_vl``
    draft reads the 384-pixel rows of the target's inputs and the replies are ``generate()``'s, pruned or not; a
    hybrid draft for a ``deepseek_vl`` target is refused at load, naming the high-resolution input it would lack."""
    hybrid = build_tiny_pair("deepseek_vl_hybrid", root=tiny_root)
    plain = build_tiny_pair("deepseek_vl", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(
        hybrid.target, plain.draft, policy="chain", torch_dtype=torch.float32
    )
    inputs = pipe.prepare_inputs(make_image(1), "Describe the picture.")
    adapter = pipe.target_adapter
    features = adapter.visual_features(inputs)["image"].embeds
    for key in ("pixel_values", "high_res_pixel_values"):
        other = adapter.visual_features({**inputs, key: inputs[key].flip(-1)})["image"].embeds
        assert not torch.allclose(other, features, atol=1e-4), key
    for prune_ratio in (None, 0.5):
        out = pipe(make_image(1), "Describe the picture.", max_new_tokens=16, prune_ratio=prune_ratio)
        assert out.token_ids == pipe.reference_generate(inputs, max_new_tokens=16)
    with pytest.raises(
        InvalidInputError, match=r"draft's high_res_vision_config.image_size is 28 but the target's is None"
    ):
        VLMSpecPipeline.from_pretrained(plain.target, hybrid.draft, policy="chain")
