"""MiniCPM-V 4.6 (``openbmb/MiniCPM-V-4.6``) and 4.7 (``openbmb/MiniCPM-V-4.7-1B``): a NaViT tower in front of
Qwen3.5's hybrid language model (Gated DeltaNet and attention layers), with 1-D positions (4.6) or Canvas M-RoPE (4.7).

The tiny pairs (``tiny:minicpmv4_6``, ``tiny:minicpmv4_7``) are in ``test_more_families.py``'s matrix (every policy,
a pruned draft, batches, a conversation) and ``test_hybrid.py``'s (a tree's paths, the visual scores, sampling, EDD
refused, host reads). Here, their own ways: a picture read whole and, when large, as slices, every item NaViT-packed
into one row of pixels; a padded batch of prompts cut back into each prompt's items; the merges the model fixes;
4.7's canvas positions.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.testing import build_tiny_pair, make_image, make_video_frames


@pytest.fixture(scope="module", params=["minicpmv4_6", "minicpmv4_7"])
def pipe(request, tiny_root):
    pair = build_tiny_pair(request.param, root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_pictures_are_read_whole_and_as_slices(pipe):
    """A small picture is one item (its whole, 8 x 8 patches: 4 tokens); a large one its whole and 4 slices, all
    packed side by side in one row of pixels (a patch column each, ``patch`` pixels tall). The reply is
    ``generate()``'s with the draft seeing every visual token or half of them."""
    pipe.policy = get_policy("sage")
    small, large = make_image(1, (24, 20)), make_image(2)
    inputs = pipe.prepare_inputs([small, large], PROMPTS[3])
    grids = inputs["target_sizes"]
    assert grids.shape[0] == 6 and inputs["pixel_values"].shape[0] == 1
    assert inputs["pixel_values"].shape[-1] == int(grids.prod(-1).sum()) * inputs["pixel_values"].shape[2]
    placeholders = int((inputs["input_ids"] == pipe.target.config.image_token_id).sum())
    assert placeholders == int(grids.prod(-1).sum()) // 16
    expected = pipe.reference_generate(inputs, 24)
    assert pipe([small, large], PROMPTS[3], max_new_tokens=24).token_ids == expected
    assert pipe([small, large], PROMPTS[3], max_new_tokens=24, prune_ratio=0.5).token_ids == expected
    with pytest.raises(InvalidInputError, match="downsample_mode, which the model fixes"):
        pipe(small, PROMPTS[0], mm_processor_kwargs={"downsample_mode": "4x"})


def test_a_padded_batch_splits_into_each_prompt_s_own_media(pipe):
    """One processor batch of a prompt with a large picture (5 items), one with a small and a large one (6), one
    with a video (4 frames) and one with text only: each row's pixels are its prompt's own packed columns, and
    ``pipe.generate`` on the batch gives each prompt's reply."""
    pipe.policy = get_policy("chain")
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4)], None),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
         [make_image(5, (20, 36)), make_image(6)], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[1]}], [], make_video_frames(2)),
        ([{"type": "text", "text": PROMPTS[2]}], [], None),
    ]  # fmt: skip

    def same_media(row, alone, b):
        for key in ("pixel_values", "target_sizes", "pixel_values_videos", "target_sizes_videos"):
            assert (key in row) == (key in alone), (b, key)
            if key in alone:
                assert torch.equal(row[key], alone[key]), (b, key)

    batch = check_a_padded_batch_splits_into_its_prompts(pipe, prompts, same_media)
    assert batch["target_sizes"].shape[0] == 11 and batch["target_sizes_videos"].shape[0] == 4


def test_4_7_lays_a_picture_s_tokens_out_on_its_canvas(pipe):
    """MiniCPM-V 4.7's prompt positions are its ``get_rope_index``'s: a picture's tokens share a time and spread over
    rows and columns, so the three rows differ there; decoding goes on after the prompt's largest position. 4.6's
    are the model's default 1-D ones."""
    inputs = pipe.prepare_inputs(make_image(2), PROMPTS[0])
    positions, delta = pipe.target_adapter.prompt_rope(inputs)  # [3, 1, L] or None, a scalar
    if pipe.target.config.model_type == "minicpmv4_6":
        assert positions is None and int(delta) == 0
        return
    visual = inputs["input_ids"][0] == pipe.target.config.image_token_id
    assert not torch.equal(positions[1, 0, visual], positions[2, 0, visual])
    assert int(positions.max()) + 1 == inputs["input_ids"].shape[1] + int(delta)
