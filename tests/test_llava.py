"""LLaVA-1.5 (``llava-hf/llava-1.5-7b-hf`` drafting for ``-13b-hf``) and LLaVA-NeXT (``llava-v1.6-vicuna-7b-hf``
drafting for ``-13b-hf``): the tiny ``llava`` pair (a CLIP tower whose second-to-last layer's patches, CLS dropped,
become the picture's tokens; a Llama language model) and ``llava_next`` pair (the same, each picture also cut into
the anyres grid of crops that fits it, unpadded to its aspect) are lossless like the other families
(``test_more_families.py``), and so is LLaVA-NeXT-Video's (``tiny:llava_next_video``: LLaVA-NeXT's pictures, videos
whose frames are pooled). Here: their layouts, pictures of other sizes, and the LLaVA models that read pictures
another way, refused with what to load instead."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts
from transformers import LlavaConfig, LlavaForConditionalGeneration

from vlmspec import VLMSpecPipeline
from vlmspec.errors import InvalidInputError
from vlmspec.models import adapter_for, check_model_type
from vlmspec.testing import build_tiny_pair, input_kinds, make_image, make_video_frames

MAX_NEW = 48
MEDIA = {"image": make_image(0), "two_images": [make_image(1), make_image(2)], "text": None}


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_the_pair_is_llava_s_architecture_and_its_pictures_steer_the_replies(family, tiny_root):
    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    assert input_kinds(family) == ("image", "two_images", "text")
    for model in (pipe.target, pipe.draft):
        assert (
            type(model).__name__
            == {"llava": "Llava", "llava_next": "LlavaNext"}[family] + "ForConditionalGeneration"
        )
        assert model.config.vision_config.model_type == "clip_vision_model"
        assert model.config.get_text_config().model_type == "llama"
        assert model.config.vision_feature_select_strategy == "default"
    image_id = pipe.target.config.image_token_id
    inputs = {kind: pipe.prepare_inputs(MEDIA[kind], PROMPTS[0]) for kind in input_kinds(family)}
    tokens = {kind: int((given["input_ids"] == image_id).sum()) for kind, given in inputs.items()}
    # 2 x 2 patches of 14 pixels a crop; LLaVA-NeXT: a 56-pixel picture is the base crop and a 2 x 2 grid of crops,
    # 4 x 4 patches, each row of them followed by a newline
    picture = {"llava": 4, "llava_next": 4 + 4 * (4 + 1)}[family]
    assert tokens == {"image": picture, "two_images": 2 * picture, "text": 0}
    other = pipe.reference_generate(pipe.prepare_inputs(make_image(5), PROMPTS[0]), MAX_NEW)
    assert other != pipe.reference_generate(
        inputs["image"], MAX_NEW
    )  # another picture, same prompt: another reply


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


def test_llava_next_pictures_of_other_sizes_alone_and_in_a_batch(tiny_root):
    """A LLaVA-NeXT picture's token count follows its size (the grid that fits it, unpadded to its aspect): wide,
    tall and square pictures alone, with a pruned draft, and together in one batch (each row's pictures told apart by
    their sizes) give ``generate()``'s replies."""
    pair = build_tiny_pair("llava_next", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    pictures = [
        make_image(0).resize((90, 30)),
        make_image(1).resize((30, 80)),
        [make_image(2), make_image(3)],
    ]
    requests = [{"image": p, "prompt": PROMPTS[i], "max_new_tokens": 24} for i, p in enumerate(pictures)]
    requests.append({"prompt": PROMPTS[3], "max_new_tokens": 24})
    image_id = pipe.target.config.image_token_id
    expected, counts = [], []
    for request in requests:
        inputs = pipe.prepare_inputs(request.get("image"), request["prompt"])
        counts.append(int((inputs["input_ids"] == image_id).sum()))
        expected.append(pipe.reference_generate(inputs, 24))
        pruned = pipe(request.get("image"), request["prompt"], max_new_tokens=24, prune_ratio=0.5)
        assert pruned.token_ids == expected[-1]
    assert len(set(counts[:2])) == 2 and counts[3] == 0  # wide and tall: other grids, other counts
    for request, want, out in zip(requests, expected, pipe.batch(requests, batch_size=4), strict=True):
        assert out.token_ids == want, request["prompt"]


def test_llava_next_video_pools_each_frame_and_reads_pictures_as_llava_next(tiny_root):
    """LLaVA-NeXT-Video (``tiny:llava_next_video``): LLaVA-NeXT's pictures, and videos whose frames' patch grids are
    average-pooled 2 x 2 (a 28-pixel frame: 2 x 2 patches, one token), which steer the replies."""
    pair = build_tiny_pair("llava_next_video", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    assert type(pipe.target).__name__ == "LlavaNextVideoForConditionalGeneration"
    assert (pipe.target.config.spatial_pool_mode, pipe.target.config.spatial_pool_stride) == ("average", 2)
    image_id, video_id = pipe.target.config.image_token_id, pipe.target.config.video_token_id
    picture = pipe.prepare_inputs(make_image(0), PROMPTS[0])
    assert int((picture["input_ids"] == image_id).sum()) == 4 + 4 * (4 + 1)  # LLaVA-NeXT's, as above
    frames = make_video_frames(0)
    video = pipe.prepare_inputs(None, PROMPTS[2], video=frames)
    assert video["pixel_values_videos"].shape[:2] == (1, len(frames))
    assert int((video["input_ids"] == video_id).sum()) == len(frames)
    other = pipe.prepare_inputs(None, PROMPTS[2], video=make_video_frames(1))
    assert pipe.reference_generate(other, MAX_NEW) != pipe.reference_generate(video, MAX_NEW)


@pytest.mark.parametrize("family", ["llava_next", "llava_next_video"])
def test_a_padded_llava_next_batch_splits_into_each_prompt_s_own_pictures(family, tiny_root):
    """A processor batch of prompts whose pictures have other sizes (other grids, other token counts), and for
    LLaVA-NeXT-Video prompts with a video too: each row's inputs are its prompt's own, its pictures told apart by
    their sizes, and ``pipe.generate`` on the batch gives each prompt's reply."""
    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4).resize((90, 30))], None),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
         [make_image(5).resize((30, 80)), make_image(6)], None),
        ([{"type": "text", "text": PROMPTS[2]}], [], None),
    ]  # fmt: skip
    if family == "llava_next_video":
        prompts.insert(
            1, ([{"type": "video"}, {"type": "text", "text": PROMPTS[1]}], [], make_video_frames(2))
        )
        prompts.append(
            ([{"type": "image"}, {"type": "video"}, {"type": "text", "text": PROMPTS[4]}], [make_image(7)],
             make_video_frames(3))
        )  # fmt: skip

    def same_media(row, alone, b):
        if "pixel_values" in alone:
            crops = alone["pixel_values"].shape[1]  # the batch pads every picture to its most crops
            assert torch.equal(row["pixel_values"][:, :crops], alone["pixel_values"]), b
            assert torch.equal(row["image_sizes"], alone["image_sizes"]), b
        assert ("pixel_values_videos" in row) == ("pixel_values_videos" in alone), b
        if "pixel_values_videos" in alone:
            assert torch.equal(row["pixel_values_videos"], alone["pixel_values_videos"]), b

    check_a_padded_batch_splits_into_its_prompts(pipe, prompts, same_media)
