"""SmolVLM2 (``SmolVLM2-256M-Video-Instruct`` drafting for ``-500M-Video-Instruct``): the tiny ``smolvlm`` pair (a
SigLIP tower whose patches are pixel-shuffled into tiles of 4 tokens; a Llama language model) is lossless like the
other families (``test_more_families.py``). Here, its own ways: a picture is cut into tiles plus a global one, a video is its frames written as tiles after their times, and a batch of prompts
pads each prompt's tiles with all-zero ones, which the model drops and vlmspec must skip the same way."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.testing import build_tiny_pair, make_image, make_video_frames

MEDIA = {
    "image": (make_image(0), None),
    "two_images": ([make_image(1), make_image(2)], None),
    "video": (None, make_video_frames(3)),
    "text": (None, None),
}


@pytest.fixture(scope="module")
def smolvlm(tiny_root):
    """The pair's pipeline."""
    pair = build_tiny_pair("smolvlm", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)


def test_pictures_are_tiles_and_a_video_its_frames_each_after_its_time(smolvlm):
    pipe = smolvlm
    cases = {
        kind: pipe.prepare_inputs(image, PROMPTS[0], video=video) for kind, (image, video) in MEDIA.items()
    }
    for model in (pipe.target, pipe.draft):
        assert type(model).__name__ == "SmolVLMForConditionalGeneration"
        assert model.config.get_text_config().model_type == "llama"
    image_id = pipe.target.config.image_token_id
    tiles = {
        kind: inputs["pixel_values"].shape[1] for kind, inputs in cases.items() if "pixel_values" in inputs
    }
    assert tiles == {"image": 5, "two_images": 10, "video": 4}  # a 56-pixel picture: 2 x 2 tiles and itself
    for kind, inputs in cases.items():
        if kind in tiles:
            assert int((inputs["input_ids"] == image_id).sum()) == 4 * tiles[kind], kind
    assert pipe.tokenizer.decode(cases["video"]["input_ids"][0]).count("Frame from 00:0") == 4


def test_a_padded_batch_splits_into_each_prompt_s_own_tiles(smolvlm):
    """The processor pads a batch's prompts to the most tiles with all-zero tiles: each row's inputs are its prompt's
    own (padding dropped as the model drops it), and ``pipe.generate`` on the batch gives each prompt's reply."""
    pipe = smolvlm
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
    assert batch["pixel_values"].shape[:2] == (3, 10)  # 5 tiles, 2 x 5, none: padded to 10
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
