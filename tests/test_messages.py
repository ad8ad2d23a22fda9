"""Conversations in transformers' chat format: pipe(messages=[...]) equals the target's generate() on the same
messages (system, user and assistant turns, images in several turns), for every family."""

from __future__ import annotations

import pytest
import torch

from vlmspec import VLMSpecPipeline
from vlmspec.testing import FAMILIES, make_image, make_video_frames

MAX_NEW = 32


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "image", "image": make_image(0)}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Some shapes."}]},
        {"role": "user", "content": [{"type": "image", "image": make_image(1)}, {"type": "text", "text": "And now?"}]},
    ]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_messages_equal_generate_on_the_same_messages(tiny_pairs, family):
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    reference_inputs = pipe.processor.apply_chat_template(
        conversation(), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )  # transformers' own path from messages to inputs
    expected = pipe.reference_generate(dict(reference_inputs), MAX_NEW)
    out = pipe(messages=conversation(), max_new_tokens=MAX_NEW)
    assert out.token_ids == expected
    assert torch.equal(pipe.prepare_messages(conversation())["input_ids"], reference_inputs["input_ids"])
    assert out.stats.target_visual_tokens > 0


def test_a_video_message_is_the_short_forms_video(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    frames = make_video_frames(0)
    messages = [
        {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "Go."}]}
    ]
    short = pipe.prepare_inputs(None, "Go.", video=frames)
    long = pipe.prepare_messages(messages)
    assert all(torch.equal(short[k], long[k]) for k in short if torch.is_tensor(short[k]))
    assert (
        pipe(messages=messages, max_new_tokens=16).token_ids
        == pipe(None, "Go.", video=frames, max_new_tokens=16).token_ids
    )


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ("hello", "messages must be a non-empty list"),
        ([{"role": "robot", "content": "hi"}], "role 'robot' is not one of system, user, assistant"),
        ([{"content": "hi"}], "messages[0] must be a dict with 'role' and 'content'"),
        (
            [{"role": "user", "content": [{"type": "audio"}]}],
            "messages[0].content[0]: expected an item of type",
        ),
        (
            [{"role": "user", "content": [{"type": "image"}]}],
            "this image item has no image: put it under 'image'",
        ),
    ],
)
def test_bad_messages_are_named(tiny_pairs, messages, error):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    with pytest.raises((ValueError, TypeError)) as caught:
        pipe(messages=messages)
    assert error in str(caught.value)
