"""SmolVLM2 (``SmolVLM2-256M-Video-Instruct`` drafting for ``-500M-Video-Instruct``) and Idefics3 (SmolVLM 1,
``SmolVLM-256M-Instruct`` drafting for ``-500M-Instruct``): the tiny ``smolvlm`` and ``idefics3`` pairs (a SigLIP
tower whose patches are pixel-shuffled into tiles of 4 tokens; a Llama language model) are lossless like the other
families (``test_more_families.py``). Here, their own ways: a picture is cut into tiles plus a global one; SmolVLM2
writes a video as its frames, tiles after their times, where Idefics3, which has no video processor, is given the
frames as pictures; and a batch of prompts pads each prompt's tiles with all-zero ones, which the model drops and
vlmspec must skip the same way."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.errors import InvalidInputError
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
    return _pipeline("smolvlm", tiny_root)


@pytest.fixture(scope="module")
def idefics3(tiny_root):
    """The pair's pipeline."""
    return _pipeline("idefics3", tiny_root)


def _pipeline(family, tiny_root):
    pair = build_tiny_pair(family, root=tiny_root)
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


def test_a_prompt_with_pictures_and_a_video_is_refused_with_what_to_do(smolvlm):
    """SmolVLM2's processor returns a prompt's picture tiles and its video's frames under one name, the frames'
    replacing the pictures' (9 tiles written, 4 given): such a prompt, or a conversation with both, is refused before
    it reaches the model, saying why and what to do."""
    pipe = smolvlm
    text = pipe.processor.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": PROMPTS[1]}],
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    raw = pipe.processor(
        text=[text], images=[make_image(0)], videos=[make_video_frames(3)], return_tensors="pt"
    )
    written = int((raw["input_ids"] == pipe.target.config.image_token_id).sum()) // 4
    assert (written, raw["pixel_values"].shape[1]) == (9, 4)
    with pytest.raises(InvalidInputError, match=r"1 picture\(s\) and 1 video\(s\).*pixel_values.*separate"):
        pipe(make_image(0), PROMPTS[1], video=make_video_frames(3), max_new_tokens=8)
    turns = [
        {
            "role": "user",
            "content": [{"type": "image", "image": make_image(0)}, {"type": "text", "text": "Hi"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
        {
            "role": "user",
            "content": [{"type": "video", "video": make_video_frames(3)}, {"type": "text", "text": "?"}],
        },
    ]
    with pytest.raises(InvalidInputError, match="SmolVLM2's processor"):
        pipe.prepare_messages(turns)


def test_idefics3_is_given_a_video_as_its_frames_pictures(idefics3):
    """Idefics3 (SmolVLM 1) has no video processor: a video reaches it as its frames, each a picture (cut into tiles
    like any picture) after a label with its time; sage's replies are ``generate()``'s."""
    pipe = idefics3
    for model in (pipe.target, pipe.draft):
        assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    assert getattr(pipe.processor, "video_processor", None) is None
    frames = make_video_frames(3)
    inputs = pipe.prepare_inputs(None, PROMPTS[0], video=frames)
    picture = pipe.prepare_inputs(frames[0], PROMPTS[0])
    tiles = picture["pixel_values"].shape[1]
    assert inputs["pixel_values"].shape[:2] == (1, len(frames) * tiles)
    assert pipe.tokenizer.decode(inputs["input_ids"][0]).count("Frame at ") == len(frames)
    pipe.policy = get_policy("sage")
    out = pipe(None, PROMPTS[0], video=frames, max_new_tokens=32)
    assert out.token_ids == pipe.reference_generate(inputs, 32)
    assert out.stats.mean_accepted > 0


@pytest.mark.parametrize("family", ["smolvlm", "idefics3"])
def test_a_padded_batch_splits_into_each_prompt_s_own_tiles(family, request):
    """The processor pads a batch's prompts to the most tiles with all-zero tiles: each row's inputs are its prompt's
    own (padding dropped as the model drops it), and ``pipe.generate`` on the batch gives each prompt's reply."""
    pipe = request.getfixturevalue(family)
    pipe.policy = get_policy("sage")
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4).resize((28, 20))], None),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
         [make_image(5), make_image(6)], None),
        ([{"type": "text", "text": PROMPTS[2]}], [], None),
    ]  # fmt: skip

    def same_tiles(row, alone, b):
        assert ("pixel_values" in row) == ("pixel_values" in alone), b
        if "pixel_values" in alone:
            assert torch.equal(row["pixel_values"], alone["pixel_values"]), b

    batch = check_a_padded_batch_splits_into_its_prompts(pipe, prompts, same_tiles, nested_images=True)
    assert batch["pixel_values"].shape[:2] == (3, 10)  # 5 tiles, 2 x 5, none: padded to 10
