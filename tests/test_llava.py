"""LLaVA-1.5 (``llava-hf/llava-1.5-7b-hf`` drafting for ``-13b-hf``): the tiny ``llava`` pair (a CLIP tower whose
second-to-last layer's patches, CLS dropped, become the picture's tokens; a Llama language model) is lossless like
the other families, alone, with a pruned draft, in batches and conversations; a video reaches it as its frames'
pictures. LLaVA models that read pictures another way are refused with what to load instead."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_conversation_with_pictures_equals_generate
from test_batching import check_batch_equals_generate, check_replies_equal_generate, mixed_requests
from transformers import LlavaConfig, LlavaForConditionalGeneration

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.errors import InvalidInputError
from vlmspec.models import adapter_for, check_model_type
from vlmspec.testing import build_tiny_pair, input_kinds, make_image, make_video_frames

POLICIES = ("ar", "chain", "static", "sage", "eagle2")
MAX_NEW = 48
MEDIA = {"image": make_image(0), "two_images": [make_image(1), make_image(2)], "text": None}


@pytest.fixture(scope="module")
def llava(tiny_root):
    """The pair's pipeline, and ``generate()``'s reply to every input kind x two prompts."""
    pair = build_tiny_pair("llava", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    cases = []
    for kind in input_kinds("llava"):
        for prompt in PROMPTS[:2]:
            inputs = pipe.prepare_inputs(MEDIA[kind], prompt)
            cases.append((kind, prompt, MEDIA[kind], pipe.reference_generate(inputs, MAX_NEW), inputs))
    return pipe, cases


def test_the_pair_is_llava_1_5_s_architecture_and_its_pictures_steer_the_replies(llava):
    pipe, cases = llava
    assert input_kinds("llava") == ("image", "two_images", "text")
    for model in (pipe.target, pipe.draft):
        assert type(model).__name__ == "LlavaForConditionalGeneration"
        assert model.config.vision_config.model_type == "clip_vision_model"
        assert model.config.get_text_config().model_type == "llama"
        assert model.config.vision_feature_select_strategy == "default"
    image_id = pipe.target.config.image_token_id
    tokens = {kind: int((inputs["input_ids"] == image_id).sum()) for kind, _, _, _, inputs in cases}
    assert tokens == {"image": 4, "two_images": 8, "text": 0}  # 2 x 2 patches of 14 pixels a picture
    other = pipe.reference_generate(pipe.prepare_inputs(make_image(5), PROMPTS[0]), MAX_NEW)
    assert other != cases[0][3]  # another picture, same prompt: another reply


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate(llava, policy):
    pipe, cases = llava
    calls = [
        (f"{kind}/{prompt!r}", {"image": image, "prompt": prompt, "max_new_tokens": MAX_NEW}, expected)
        for kind, prompt, image, expected, _ in cases
    ]
    check_replies_equal_generate(pipe, policy, calls)


def test_a_pruned_draft_keeps_the_replies(llava):
    """The draft sees half of each picture's tokens (its prefill built by vlmspec from the model's own features)."""
    pipe, cases = llava
    pipe.policy = get_policy("sage")
    for kind, prompt, image, expected, _ in cases:
        if image is None:
            continue
        out = pipe(image, prompt, max_new_tokens=MAX_NEW, prune_ratio=0.5)
        assert out.token_ids == expected, f"pruned/{kind}/{prompt!r}"
        assert out.stats.draft_visual_tokens == out.stats.target_visual_tokens // 2


@pytest.mark.parametrize("policy", ["chain", "sage"])
def test_a_batch_equals_each_request_s_generate(llava, policy):
    pipe, _ = llava
    pipe.policy = get_policy(policy)
    check_batch_equals_generate(pipe, mixed_requests(without=("video",)), policy)


def test_a_conversation_with_pictures_in_two_turns(llava):
    """Later turns prefill on the caches of the earlier ones (their pictures included)."""
    check_a_conversation_with_pictures_equals_generate(llava[0])


def test_a_video_is_given_as_its_frames_pictures(llava):
    """LLaVA-1.5 takes no video: a video's frames reach it as pictures, each with a label of its time (the template
    writes a turn's pictures before its text, as LLaVA-1.5's does)."""
    pipe, _ = llava
    frames = make_video_frames(0)
    messages = [
        {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "Why?"}]}
    ]
    inputs = pipe.prepare_messages(messages)
    assert inputs["pixel_values"].shape[0] == len(frames)
    prompt = pipe.tokenizer.decode(inputs["input_ids"][0])
    assert (
        prompt.startswith("USER: <image>") and "Frame at 1.5 s:" in prompt and prompt.endswith("ASSISTANT:")
    )
    pipe.policy = get_policy("sage")
    out = pipe(messages=messages, max_new_tokens=MAX_NEW)
    assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW)
    assert out.stats.mean_accepted > 0


def test_llava_checkpoints_that_read_pictures_another_way_are_refused():
    """The original LLaVA-1.5 checkpoints run their own code; a LLaVA model with a Pixtral tower reads each picture at
    its own size. Both are refused, saying what to load instead."""
    with pytest.raises(InvalidInputError, match=r"llava_llama.*llava-hf/llava-1\.5-7b-hf"):
        check_model_type("llava_llama", "liuhaotian/llava-v1.5-7b")
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = LlavaConfig(
        vision_config={"model_type": "pixtral", **tiny, "head_dim": 16, "image_size": 32, "patch_size": 16},
        text_config={"model_type": "llama", **tiny, "vocab_size": 64},
        image_token_index=63,
    )
    with pytest.raises(InvalidInputError, match=r"'pixtral' vision tower reads each picture at its own size"):
        adapter_for(LlavaForConditionalGeneration(config))
