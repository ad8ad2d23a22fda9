"""GLM-4.6V (``GLM-4.6V-Flash`` drafting for ``GLM-4.6V``; GLM-4.1V and GLM-4.5V are the same design): the tiny
``glm46v`` pair (a ViT of 14-pixel patches merged 2 x 2, a GLM-4 language model whose M-RoPE turns half of each
head) is lossless like the other families (``test_more_families.py``). Here, its own way: a video is written as its
frames, each with its time, in the pictures' placeholder token, told apart from the pictures by the processor's
``mm_token_type_ids`` only, in one prompt, in pruning and in a padded batch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.pruning import PruningConfig
from vlmspec.testing import build_tiny_pair, make_image, make_video_frames


@pytest.fixture(scope="module")
def glm(tiny_root):
    pair = build_tiny_pair("glm46v", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_a_video_s_frames_are_written_with_the_pictures_placeholder(glm):
    pipe = glm
    for model in (pipe.target, pipe.draft):
        assert type(model).__name__ == "Glm46VForConditionalGeneration"
        text = model.config.get_text_config()
        assert (text.model_type, text.rope_parameters["partial_rotary_factor"]) == ("glm4v_text", 0.5)
    image_id, video_id = pipe.target.config.image_token_id, pipe.target.config.video_token_id
    for image, video, seen in ((make_image(0), None, (4, 0)), (None, make_video_frames(1), (0, 8))):
        inputs = pipe.prepare_inputs(image, PROMPTS[1], video=video)
        ids, types = inputs["input_ids"][0], inputs["mm_token_type_ids"][0]
        assert int((ids == video_id).sum()) == 0  # no video token: the frames' placeholders are the pictures'
        assert set(ids[types > 0].tolist()) == {image_id}
        assert (int((types == 1).sum()), int((types == 2).sum())) == seen  # 56 pixels; 4 frames, 2 at a time
    assert pipe.tokenizer.decode(ids).count(" seconds") == 2


def test_a_video_is_pruned_by_the_video_ratio_and_refused_beside_pictures(glm):
    """The draft keeps every picture token and half a video's: only ``mm_token_type_ids`` tells them apart. A prompt
    with both is refused, as the model's own forward refuses it (its video mask is its picture mask)."""
    pipe = glm
    pipe.policy = get_policy("sage")
    pipe.pruning = PruningConfig(method="uniform", image_ratio=0.0, video_ratio=0.5, min_keep=0)
    try:
        for image, video, kept in ((make_image(2), None, 4), (None, make_video_frames(3), 4)):
            expected = pipe.reference_generate(pipe.prepare_inputs(image, PROMPTS[4], video=video), 32)
            out = pipe(image, PROMPTS[4], video=video, max_new_tokens=32)
            assert out.token_ids == expected
            assert (out.stats.target_visual_tokens, out.stats.draft_visual_tokens) == (
                4 if image else 8,
                kept,
            )
        with pytest.raises(InvalidInputError, match=r"1 picture\(s\) and 1 video\(s\).*GLM-V"):
            pipe(make_image(2), PROMPTS[4], video=make_video_frames(3), max_new_tokens=8)
    finally:
        pipe.pruning = PruningConfig()


def test_a_padded_processor_batch_splits_into_each_prompt_s_pictures_and_video(glm):
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4)], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[2]}], [], make_video_frames(2)),
        ([{"type": "text", "text": PROMPTS[3]}], [], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[1]}], [], make_video_frames(4)),
    ]

    def same_media(row, alone, b):
        assert torch.equal(row["mm_token_type_ids"], alone["mm_token_type_ids"]), b
        for key in ("pixel_values", "pixel_values_videos", "video_grid_thw"):
            assert (key in row) == (key in alone), (b, key)
            if key in alone:
                assert torch.equal(row[key], alone[key]), (b, key)

    check_a_padded_batch_splits_into_its_prompts(glm, prompts, same_media)


def test_a_glm_4_1v_model_drafts_for_a_glm_4_6v_target(tiny_root, tmp_path):
    """GLM-4.1V (``glm4v``) and GLM-4.6V (``glm46v``) differ in ``model_type`` only where vlmspec looks (the same
    processor, placeholders and tower layout), so one drafts for the other (``vlmspec.loading.SERIES``): the tiny
    draft written as a ``glm4v`` model drafts for the ``glm46v`` target, and the replies stay ``generate()``'s."""
    pair = build_tiny_pair("glm46v", root=tiny_root)
    draft = tmp_path / "glm4v-draft"
    shutil.copytree(pair.draft, draft)
    config = json.loads((draft / "config.json").read_text())
    config.update(model_type="glm4v", architectures=["Glm4vForConditionalGeneration"])
    (draft / "config.json").write_text(json.dumps(config))
    pipe = VLMSpecPipeline.from_pretrained(pair.target, draft, policy="sage", torch_dtype=torch.float32)
    assert (type(pipe.target).__name__, type(pipe.draft).__name__) == (
        "Glm46VForConditionalGeneration",
        "Glm4vForConditionalGeneration",
    )
    accepted = 0
    for image, video in ((make_image(0), None), (None, make_video_frames(1))):
        inputs = pipe.prepare_inputs(image, PROMPTS[0], video=video)
        expected = pipe.reference_generate(inputs, max_new_tokens=24)
        out = pipe(image, PROMPTS[0], video=video, max_new_tokens=24)
        assert out.token_ids == expected
        accepted += out.stats.accepted_tokens
    assert accepted > 0
