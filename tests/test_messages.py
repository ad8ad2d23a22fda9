"""Conversations in transformers' chat format: pipe(messages=[...]) equals the target's generate() on the same
messages (system, user and assistant turns, images in several turns), for every family."""

from __future__ import annotations

import pytest
import torch
from transformers.video_utils import VideoMetadata

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


@pytest.mark.parametrize("family", FAMILIES)
def test_several_videos_in_one_prompt_equal_generate(tiny_pairs, family):
    """Two clips (one a time window of a longer one) and an image in one turn: the target's generate() on the
    processor's outputs for the same frames, token for token."""
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    first, second = make_video_frames(0), make_video_frames(1, num_frames=8)
    content = [
        {"type": "video", "video": first},
        {"type": "image", "image": make_image(2)},
        {"type": "video", "video": second, "video_start": 1.0, "video_end": 2.5},
        {"type": "text", "text": "What changed?"},
    ]
    out = pipe(messages=[{"role": "user", "content": content}], max_new_tokens=MAX_NEW)
    placeholders = [{"type": item["type"]} if item["type"] != "text" else item for item in content]
    text = pipe.processor.apply_chat_template(
        [{"role": "user", "content": placeholders}], add_generation_prompt=True, tokenize=False
    )
    metadata = [  # the clip's frames keep their place in the video: Qwen3-VL's timestamps read it
        VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3]),
        VideoMetadata(total_num_frames=8, fps=2.0, frames_indices=[2, 3, 4, 5]),
    ]
    inputs = pipe.processor(
        text=[text], images=[[make_image(2)]], videos=[first, second[2:6]], video_metadata=metadata,
        do_sample_frames=False, return_tensors="pt",
    )  # fmt: skip
    assert out.token_ids == pipe.reference_generate(dict(inputs), MAX_NEW)
    assert out.stats.target_visual_tokens > 0


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
