"""Perception LM (``Perception-LM-1B`` drafting for ``-8B``): the tiny ``perception_lm`` pair (timm's Perception
Encoder reading tiles, the projected patches pooled 2 x 2, a Llama language model) is lossless like the other
families (``test_more_families.py``). Here, its own ways: a picture as a thumbnail and its tiles, a request's tile
budget, a padded batch of prompts cut back into each prompt's media, and the tower's geometry read from timm's
``model_args`` when a draft is checked."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.loading import check_visual_layout
from vlmspec.testing import build_tiny_pair, make_image, make_video_frames

TOKENS_PER_TILE = 4  # tiles of 32 pixels: 4 x 4 patches of 8, pooled 2 x 2


@pytest.fixture(scope="module")
def pipe(tiny_root):
    pair = build_tiny_pair("perception_lm", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_pictures_of_any_shape_are_a_thumbnail_and_their_tiles(pipe):
    """Every picture is read as a thumbnail plus the grid of ``max_num_tiles`` tiles that fits its shape (a square,
    a wide and a tall one in one prompt: 5 tiles each); a request asking for fewer tiles gets fewer tokens, and each
    reply is ``generate()``'s on the same inputs."""
    image_id = pipe.target.config.image_token_id
    pictures = [make_image(1), make_image(4).resize((64, 20)), make_image(5).resize((20, 96))]
    for settings, tiles in (({}, 5), ({"max_num_tiles": 1}, 2)):
        inputs = pipe.prepare_inputs(pictures, PROMPTS[3], mm_processor_kwargs=settings)
        assert inputs["pixel_values"].shape[:2] == (3, tiles)
        assert int((inputs["input_ids"] == image_id).sum()) == 3 * tiles * TOKENS_PER_TILE
        out = pipe(pictures, PROMPTS[3], max_new_tokens=24, mm_processor_kwargs=settings)
        assert out.token_ids == pipe.reference_generate(inputs, 24), settings
    with pytest.raises(InvalidInputError, match="tile_size, which the model fixes"):
        pipe(pictures[0], PROMPTS[0], mm_processor_kwargs={"tile_size": 64})


def test_a_picture_and_a_video_in_one_prompt(pipe):
    """One prompt holding a picture (its 5 tiles) and a video (its 4 frames, a tile each): ``sage``'s reply is
    ``generate()``'s, with the draft seeing every visual token or half of them."""
    pipe.policy = get_policy("sage")
    call = {"image": make_image(1), "video": make_video_frames(2), "prompt": PROMPTS[3], "max_new_tokens": 24}
    inputs = pipe.prepare_inputs(call["image"], call["prompt"], video=call["video"])
    assert inputs["pixel_values"].shape[:2] == (1, 5) and inputs["pixel_values_videos"].shape[:2] == (1, 4)
    expected = pipe.reference_generate(inputs, 24)
    assert pipe(**call).token_ids == expected
    assert pipe(**call, prune_ratio=0.5).token_ids == expected


def test_a_padded_batch_splits_into_each_prompt_s_own_media(pipe):
    """One processor batch of a prompt with a picture, one with two, one with a video and one with text only: each
    row's inputs are its prompt's own, and ``pipe.generate`` on the batch gives each prompt's reply."""
    pipe.policy = get_policy("sage")
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4)], None),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
         [make_image(5), make_image(6)], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[1]}], [], make_video_frames(2)),
        ([{"type": "text", "text": PROMPTS[2]}], [], None),
    ]  # fmt: skip

    def same_media(row, alone, b):
        for key in ("pixel_values", "pixel_values_videos"):
            assert (key in row) == (key in alone), (b, key)
            if key in alone:
                assert torch.equal(row[key], alone[key]), (b, key)

    batch = check_a_padded_batch_splits_into_its_prompts(pipe, prompts, same_media)
    assert batch["pixel_values"].shape[0] == 3 and batch["pixel_values_videos"].shape[0] == 1


def test_a_draft_whose_tower_reads_other_tiles_is_refused(pipe, tiny_root, tmp_path):
    """The tower's input size sits in timm's ``model_args``: a draft whose tiles differ from the target's is refused,
    naming that field and both values (the check itself: a tower of another input size has weights of other shapes,
    which a copy of the tiny draft lacks); a draft pooling its patches otherwise is refused when it loads."""
    draft = copy.deepcopy(pipe.draft)
    draft.config.vision_config.model_args["img_size"] = [64, 64]
    with pytest.raises(
        InvalidInputError, match=r"vision_config\.model_args\.img_size is \[64, 64\] but the target"
    ):
        check_visual_layout(pipe.target, draft)
    pair = build_tiny_pair("perception_lm", root=tiny_root)
    folder = tmp_path / "draft"
    shutil.copytree(pair.draft, folder)
    config = json.loads((folder / "config.json").read_text())
    config["projector_pooling_ratio"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        InvalidInputError, match="the draft's projector_pooling_ratio is 1 but the target's is 2"
    ):
        VLMSpecPipeline.from_pretrained(pair.target, folder, torch_dtype=torch.float32)
