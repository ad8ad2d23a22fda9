"""Mistral 3 (``Ministral-3-3B-Instruct-2512`` drafting for ``Ministral-3-14B-Instruct-2512``): the tiny ``mistral3``
pair (a Pixtral tower reading each picture at its own size, 2 x 2 patches merged into a token; a Ministral 3 language
model whose queries are scaled up past ``original_max_position_embeddings``, 32 in the fixture, so within every
reply) is lossless like the other families (``test_more_families.py``). Here, its own ways: a picture's token count
follows its size, a batch's pictures are padded to the largest (pixels and prompts alike), and a conversation whose
later picture is larger reuses the earlier turn's cache."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    PROMPTS,
    check_a_conversation_with_pictures_equals_generate,
    check_a_padded_batch_splits_into_its_prompts,
)

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.testing import build_tiny_pair, make_image

WIDE, TALL = make_image(4).resize((90, 30)), make_image(5).resize((30, 80))


@pytest.fixture(scope="module")
def mistral3(tiny_root):
    pair = build_tiny_pair("mistral3", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def _tokens(pipe, picture) -> int:
    inputs = pipe.prepare_inputs(picture, PROMPTS[0])
    return int((inputs["input_ids"] == pipe.target.config.image_token_id).sum())


def test_the_pair_is_mistral_3_and_a_picture_s_tokens_follow_its_size(mistral3):
    pipe = mistral3
    for model in (pipe.target, pipe.draft):
        assert type(model).__name__ == "Mistral3ForConditionalGeneration"
        assert model.config.vision_config.model_type == "pixtral"
        assert model.config.get_text_config().model_type == "ministral3"
    assert pipe.target.config.get_text_config().rope_parameters["original_max_position_embeddings"] == 32
    # 14 pixels a token (patches of 7, merged 2 x 2), the longest side resized to 56: 4 x 4, 4 x 2 (rounded up), 2 x 4
    assert [_tokens(pipe, p) for p in (make_image(0), WIDE, TALL)] == [16, 8, 8]
    inputs = pipe.prepare_inputs(WIDE, PROMPTS[0])
    assert inputs["image_sizes"].tolist() == [[28, 56]]
    assert pipe.reference_generate(inputs, 32) != pipe.reference_generate(
        pipe.prepare_inputs(TALL, PROMPTS[0]), 32
    )


def test_pictures_of_other_sizes_alone_pruned_and_batched(mistral3):
    pipe = mistral3
    pipe.policy = get_policy("sage")
    requests = [
        {"image": WIDE, "prompt": PROMPTS[0], "max_new_tokens": 40},
        {"image": [TALL, make_image(6)], "prompt": PROMPTS[3], "max_new_tokens": 40},
        {"prompt": PROMPTS[2], "max_new_tokens": 40},
        {"image": make_image(7), "prompt": PROMPTS[1], "max_new_tokens": 40},
    ]
    expected = []
    for request in requests:
        expected.append(
            pipe.reference_generate(pipe.prepare_inputs(request.get("image"), request["prompt"]), 40)
        )
        out = pipe(request.get("image"), request["prompt"], max_new_tokens=40, prune_ratio=0.5)
        assert out.token_ids == expected[-1], request["prompt"]
    for request, want, out in zip(requests, expected, pipe.batch(requests, batch_size=4), strict=True):
        assert out.token_ids == want, request["prompt"]


def test_a_padded_processor_batch_splits_into_each_prompt_s_own_pictures(mistral3):
    """The processor pads a batch's pictures to the largest: each row's inputs are its prompt's own (its pictures
    told apart by their sizes, their pixels within their sizes the same), and ``pipe.generate`` on the batch gives
    each prompt's reply."""
    prompts = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [WIDE], None),
        ([{"type": "text", "text": PROMPTS[2]}], [], None),
        (
            [{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
            [TALL, make_image(6)],
            None,
        ),
    ]

    def same_pictures(row, alone, b):
        sizes = alone["image_sizes"].tolist() if "image_sizes" in alone else []
        assert (row["image_sizes"].tolist() if "image_sizes" in row else []) == sizes, b
        for picture, (h, w) in enumerate(sizes):
            assert torch.equal(
                row["pixel_values"][picture, :, :h, :w], alone["pixel_values"][picture, :, :h, :w]
            )

    batch = check_a_padded_batch_splits_into_its_prompts(mistral3, prompts, same_pictures)
    assert batch["pixel_values"].shape[-2:] == (56, 56)


def test_a_conversation_whose_later_picture_is_larger_reuses_the_earlier_turn(mistral3):
    """The second turn's larger picture pads the first's to its size: the prefix cache compares the pictures within
    their own sizes, so the second turn still prefills on the first's cache."""
    check_a_conversation_with_pictures_equals_generate(mistral3, pictures=(WIDE, make_image(2)))
