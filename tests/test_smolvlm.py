"""SmolVLM2 (``SmolVLM2-256M-Video-Instruct`` drafting for ``-500M-Video-Instruct``): the tiny ``smolvlm`` pair (a
SigLIP tower whose patches are pixel-shuffled into tiles of 4 tokens; a Llama language model) is lossless like the
other families, alone, with a pruned draft, in batches and conversations. Its own ways are exercised: a picture is
cut into tiles plus a global one, a video is its frames written as tiles after their times, and a batch of prompts
pads each prompt's tiles with all-zero ones, which the model drops and vlmspec must skip the same way."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_conversation_with_pictures_equals_generate
from test_batching import check_batch_equals_generate, check_replies_equal_generate, mixed_requests

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.testing import build_tiny_pair, input_kinds, make_image, make_video_frames

POLICIES = ("ar", "chain", "static", "sage", "eagle2")
MAX_NEW = 48
MEDIA = {
    "image": (make_image(0), None),
    "two_images": ([make_image(1), make_image(2)], None),
    "video": (None, make_video_frames(3)),
    "text": (None, None),
}


@pytest.fixture(scope="module")
def smolvlm(tiny_root):
    """The pair's pipeline, and ``generate()``'s reply to every input kind x two prompts."""
    pair = build_tiny_pair("smolvlm", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    cases = []
    for kind in input_kinds("smolvlm"):
        image, video = MEDIA[kind]
        for prompt in PROMPTS[:2]:
            inputs = pipe.prepare_inputs(image, prompt, video=video)
            cases.append((kind, prompt, MEDIA[kind], pipe.reference_generate(inputs, MAX_NEW), inputs))
    return pipe, cases


def test_pictures_are_tiles_and_a_video_its_frames_each_after_its_time(smolvlm):
    pipe, cases = smolvlm
    for model in (pipe.target, pipe.draft):
        assert type(model).__name__ == "SmolVLMForConditionalGeneration"
        assert model.config.get_text_config().model_type == "llama"
    image_id = pipe.target.config.image_token_id
    tiles = {
        kind: inputs["pixel_values"].shape[1] for kind, _, _, _, inputs in cases if "pixel_values" in inputs
    }
    assert tiles == {"image": 5, "two_images": 10, "video": 4}  # a 56-pixel picture: 2 x 2 tiles and itself
    for kind, _, _, _, inputs in cases:
        if kind in tiles:
            assert int((inputs["input_ids"] == image_id).sum()) == 4 * tiles[kind], kind
    video = next(inputs for kind, _, _, _, inputs in cases if kind == "video")
    assert pipe.tokenizer.decode(video["input_ids"][0]).count("Frame from 00:0") == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate(smolvlm, policy):
    pipe, cases = smolvlm
    calls = [
        (
            f"{kind}/{prompt!r}",
            {"image": m[0], "video": m[1], "prompt": prompt, "max_new_tokens": MAX_NEW},
            expected,
        )
        for kind, prompt, m, expected, _ in cases
    ]
    check_replies_equal_generate(pipe, policy, calls)


def test_a_pruned_draft_keeps_the_replies(smolvlm):
    """The draft sees half of the tiles' tokens (its prefill built by vlmspec from the model's own features)."""
    pipe, cases = smolvlm
    pipe.policy = get_policy("sage")
    for kind, prompt, (image, video), expected, _ in cases:
        if image is None and video is None:
            continue
        out = pipe(image, prompt, video=video, max_new_tokens=MAX_NEW, prune_ratio=0.5)
        assert out.token_ids == expected, f"pruned/{kind}/{prompt!r}"
        assert out.stats.draft_visual_tokens == out.stats.target_visual_tokens // 2


@pytest.mark.parametrize("policy", ["chain", "sage"])
def test_a_batch_equals_each_request_s_generate(smolvlm, policy):
    """Prompts with different numbers of tiles prefill together: the processor pads each prompt's tiles with
    all-zero ones, which each request's own inputs must leave out as the model does."""
    pipe, _ = smolvlm
    pipe.policy = get_policy(policy)
    check_batch_equals_generate(pipe, mixed_requests(), policy)


def test_a_conversation_with_pictures_in_two_turns(smolvlm):
    """Later turns prefill on the caches of the earlier ones (their tiles included)."""
    check_a_conversation_with_pictures_equals_generate(smolvlm[0])


def test_a_padded_batch_splits_into_each_prompt_s_own_tiles(smolvlm):
    """The processor pads a batch's prompts to the most tiles with all-zero tiles: each row's inputs are its prompt's
    own (padding dropped as the model drops it), and ``pipe.generate`` on the batch gives each prompt's reply."""
    pipe, _ = smolvlm
    content = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4).resize((28, 20))]),
        (
            [{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
            [make_image(5), make_image(6)],
        ),
        ([{"type": "text", "text": PROMPTS[2]}], []),
    ]
    texts = [
        pipe.processor.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c, _ in content
    ]
    batch = pipe.processor(text=texts, images=[i for _, i in content], padding=True, return_tensors="pt")
    assert batch["pixel_values"].shape[:2] == (3, 10)  # 1 tile (a small picture), 2 x 5, none: padded to 10
    rows = pipe._target_adapter.split_rows(dict(batch))
    for row, text, (_, images) in zip(rows, texts, content, strict=True):
        alone = pipe.processor(text=[text], images=[images] if images else None, return_tensors="pt")
        assert torch.equal(row["input_ids"], alone["input_ids"])
        if images:
            assert torch.equal(row["pixel_values"], alone["pixel_values"])
        else:
            assert "pixel_values" not in row
    pipe.policy = get_policy("sage")
    replies = pipe.generate(**batch, max_new_tokens=24)
    for b, row in enumerate(rows):
        expected = pipe.reference_generate(dict(row), 24)
        width = batch["input_ids"].shape[1]
        assert replies[b, width : width + len(expected)].tolist() == expected, b
