"""LFM2-VL (``LFM2-VL-450M`` drafting for ``-1.6B`` or ``-3B``): a SigLIP2 NaFlex tower in front of LFM2, a hybrid
language model of short gated convolutions (recurrent layers) and attention layers, verified over trees.

The tiny pair (``tiny:lfm2_vl``: every second layer attends) is in ``test_more_families.py``'s matrix (every policy,
a pruned draft, batches, a conversation) and ``test_hybrid.py``'s (a tree's paths, the visual scores, sampling, EDD
refused, host reads). Here, what only this family has: a tree decodes as ``generate()`` with the last layer a
convolution, as in the released models; a picture read whole or cut into tiles and a thumbnail, each item its own
grid of tokens; a padded batch cut back into each prompt's items.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts
from test_hybrid import check_a_tree_decodes_as_generate

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.testing import build_tiny_pair, make_image, make_inputs


@pytest.fixture(scope="module")
def pipe(tiny_root):
    pair = build_tiny_pair("lfm2_vl", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_the_last_layer_may_be_a_convolution(pipe):
    """LFM2-VL's released models end on a convolution layer (LFM2-1.2B attends in 6 of its 16 layers, not the last)."""
    config = pipe.target.config.to_dict()
    config["text_config"] |= {"layer_types": ["full_attention", "conv", "full_attention", "conv"]}
    torch.manual_seed(0)
    model = type(pipe.target)(type(pipe.target.config)(**config)).eval()
    check_a_tree_decodes_as_generate(model, make_inputs(pipe.processor, "image"))


def test_pictures_are_read_whole_or_as_tiles_and_a_thumbnail(pipe):
    """A small picture is one item at its own aspect ratio (28 x 20 pixels: 4 x 8 patches); a large one 2 x 2 tiles of 16 pixels and a thumbnail (5
    items). Each item's tokens are its patch grid's, 2 x 2 patches each, in the prompt's order; the reply is
    ``generate()``'s with the draft seeing every visual token or half of them."""
    pipe.policy = get_policy("sage")
    small, large = make_image(1, (28, 20)), make_image(2)
    inputs = pipe.prepare_inputs([small, large], PROMPTS[3])
    grids = inputs["spatial_shapes"].tolist()
    assert len(grids) == 6 and grids[0] == [4, 8] and grids[1:5] == [[4, 4]] * 4  # [rows, columns] of patches
    placeholders = int((inputs["input_ids"] == pipe.target.config.image_token_id).sum())
    assert placeholders == sum(h // 2 * (w // 2) for h, w in grids)
    expected = pipe.reference_generate(inputs, 24)
    assert pipe([small, large], PROMPTS[3], max_new_tokens=24).token_ids == expected
    assert pipe([small, large], PROMPTS[3], max_new_tokens=24, prune_ratio=0.5).token_ids == expected
    with pytest.raises(InvalidInputError, match="encoder_patch_size, which the model fixes"):
        pipe(small, PROMPTS[0], mm_processor_kwargs={"encoder_patch_size": 8})


def test_a_padded_batch_splits_into_each_prompt_s_own_media(pipe):
    """One processor batch of a prompt with a large picture (5 items), one with a small and a large one (6), and one
    with text only: each row's inputs are its prompt's own, and ``pipe.generate`` on the batch gives each reply."""
    pipe.policy = get_policy("chain")
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4)], None),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
         [make_image(5, (20, 36)), make_image(6)], None),
        ([{"type": "text", "text": PROMPTS[2]}], [], None),
    ]  # fmt: skip

    def same_media(row, alone, b):
        assert ("pixel_values" in row) == ("pixel_values" in alone), b
        for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
            if key in alone:
                assert torch.equal(row[key], alone[key]), (b, key)

    batch = check_a_padded_batch_splits_into_its_prompts(pipe, prompts, same_media, nested_images=True)
    assert batch["pixel_values"].shape[0] == 11
