"""InternVL (InternVL3 / InternVL3.5 ``-hf`` checkpoints): what the family does its own way, beyond the test matrix
every family runs (``tests/test_lossless.py``, ``test_batching.py``, ...; the tiny ``internvl`` pair is in it).

InternVL's processor cuts a picture into tiles (plus a thumbnail when there are several) and writes a video as its
frames, each an ``<img>`` block of ``<IMG_CONTEXT>`` tokens; the model reads every tile as one row of
``pixel_values``. The adapter's media items are those blocks: these tests give it pictures of different tile counts
in one prompt and in a padded batch, and check each block's rows, the pruning of a video's frames as pictures, the
refusal of inputs whose tiles do not match, and InternVL3.5's Qwen3 language models (dense and mixture-of-experts)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from transformers import InternVLConfig, InternVLForConditionalGeneration

from vlmspec import InvalidInputError, PrefixCache, VLMSpecPipeline, get_policy
from vlmspec.models import adapter_for
from vlmspec.pruning import PruningConfig
from vlmspec.testing import make_image, make_video_frames
from vlmspec.testing.pairs import _special_token_ids
from vlmspec.testing.weights import shape_weights

MAX_NEW = 32
WIDE = (112, 28)  # four tiles side by side, plus the thumbnail
SMALL = (28, 28)  # one tile


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["internvl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def _blocks(pipe, inputs) -> list[int]:
    """Tiles of each ``<img>`` block of a batch-1 prompt, read from its text."""
    tokens = pipe.processor.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    text = "".join(t if t in ("<img>", "</img>", "<IMG_CONTEXT>") else " " for t in tokens)
    per_tile = pipe.processor.image_seq_length
    return [block.count("<IMG_CONTEXT>") // per_tile for block in text.split("<img>")[1:]]


def test_pictures_of_different_tile_counts_are_items_of_their_own(pipe):
    images = [make_image(1, WIDE), make_image(2, SMALL), make_image(3)]
    inputs = pipe.prepare_inputs(images, PROMPTS[1])
    adapter = adapter_for(pipe.target)
    assert _blocks(pipe, inputs) == [5, 1, 5]
    keep = torch.ones_like(inputs["input_ids"], dtype=torch.bool)
    assert adapter.media_counts(inputs, keep) == [(11, 0)]  # tiles: the items the tower reads one by one
    rows = inputs["pixel_values"]
    assert torch.equal(adapter.media_items(inputs, slice(5, 6), slice(0, 0))["pixel_values"], rows[5:6])
    assert torch.equal(adapter.media_items(inputs, slice(2, None), slice(0, 0))["pixel_values"], rows[2:])
    assert adapter.media_items(inputs, slice(11, None), slice(0, 0)) == {}
    for policy in ("chain", "sage", "eagle2"):
        pipe.policy = get_policy(policy)
        out = pipe(images, PROMPTS[1], max_new_tokens=MAX_NEW)
        assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW), policy
        assert out.stats.accepted_tokens > 0


def test_a_padded_batch_splits_into_each_prompt_s_own_tiles(pipe):
    content = [
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[0]}], [make_image(4, WIDE)], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[2]}], [], make_video_frames(1)),
        ([{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[3]}],
         [make_image(5, SMALL), make_image(6)], None),
    ]  # fmt: skip
    texts = [
        pipe.processor.apply_chat_template(
            [{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False
        )
        for c, _, _ in content
    ]
    batch = pipe.processor(
        text=texts, images=[i for _, i, _ in content if i], videos=[v for _, _, v in content if v is not None],
        padding=True, return_tensors="pt",
    )  # fmt: skip
    rows = adapter_for(pipe.target).split_rows(dict(batch))
    for row, text, (_, images, video) in zip(rows, texts, content, strict=True):
        alone = pipe.processor(
            text=[text], images=[images] if images else None, videos=[video] if video is not None else None,
            return_tensors="pt",
        )  # fmt: skip
        assert torch.equal(row["input_ids"], alone["input_ids"])
        assert torch.equal(row["pixel_values"], alone["pixel_values"])
    assert [adapter_for(pipe.target).media_counts(row, row["attention_mask"].bool()) for row in rows] == [
        [(5, 0)],
        [(4, 0)],
        [(6, 0)],
    ]


def test_a_video_s_frames_are_pruned_as_pictures(pipe):
    video = make_video_frames(2)
    inputs = pipe.prepare_inputs(None, PROMPTS[0], video)
    layout = adapter_for(pipe.target).prompt_layout(inputs)
    assert layout.num_visual == 4 * len(video) and not layout.is_video.any()
    pipe.pruning = PruningConfig(method="uniform", image_ratio=0.5, video_ratio=0.9, min_keep=0)
    pipe.policy = get_policy("sage")
    try:
        out = pipe(None, PROMPTS[0], video=video, max_new_tokens=MAX_NEW)
    finally:
        pipe.pruning = PruningConfig()
    assert out.stats.draft_visual_tokens == layout.num_visual // 2  # the image ratio, not the video one
    assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW)


def test_a_cached_picture_that_is_the_first_tile_of_the_next_one_gives_the_rest_of_its_tiles(pipe):
    """The prefix cache reuses a request whose one-tile picture is the next request's first tile (a crop and the
    wide picture it was cut from): the shared prefix ends inside the wide picture's block, after that tile, and the
    other four tiles go through the tower."""
    for seed in range(4):
        wide = make_image(30 + seed, WIDE)
        crop = wide.crop((0, 0, *SMALL))
        pipe.prefix_cache = PrefixCache()
        pipe.policy = get_policy("sage")
        try:
            pipe([crop], PROMPTS[0], max_new_tokens=8)
            out = pipe([wide], PROMPTS[0], max_new_tokens=MAX_NEW)
        finally:
            pipe.prefix_cache = None
        inputs = pipe.prepare_inputs([wide], PROMPTS[0])
        first_placeholder = int((inputs["input_ids"][0] == pipe.target.config.image_token_id).nonzero()[0])
        assert out.stats.cached_prompt_tokens == first_placeholder + 4, seed  # the crop's tile reused
        assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW), seed


def test_pixel_values_that_do_not_match_the_tiles_are_refused(pipe):
    inputs = dict(pipe.prepare_inputs([make_image(1, WIDE)], PROMPTS[0]))
    inputs["pixel_values"] = inputs["pixel_values"][:-1]
    with pytest.raises(InvalidInputError, match=r"make 5 tiles of 4 but pixel_values holds 4"):
        adapter_for(pipe.target).media_items(inputs, slice(0, None), slice(0, 0))
    ids = inputs["input_ids"][0]
    first = int((ids == pipe.target.config.image_token_id).nonzero()[0])
    inputs["input_ids"] = torch.cat([ids[:first], ids[first + 1 :]])[
        None
    ]  # one placeholder short of its tile
    with pytest.raises(InvalidInputError, match=r"holds 19 <IMG_CONTEXT> placeholders, not a whole number"):
        adapter_for(pipe.target).media_counts(inputs, torch.ones_like(inputs["input_ids"], dtype=torch.bool))


def test_remote_code_internvl_checkpoints_are_pointed_to_their_hf_versions():
    model = torch.nn.Linear(1, 1)
    model.config = type("Config", (), {"model_type": "internvl_chat"})()
    with pytest.raises(InvalidInputError, match=r"'internvl_chat' is not supported.*InternVL3-8B-hf"):
        adapter_for(model)


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1}


@pytest.mark.parametrize("language_model", ["qwen3", "qwen3_moe"])
def test_internvl3_5_s_qwen3_language_models_are_lossless(pipe, language_model):
    """InternVL3.5 puts a Qwen3 language model (q/k norms, explicit head width) behind the same tower: dense, or
    sparse in InternVL3_5-30B-A3B (each token routed to 2 of 4 experts here)."""
    config = pipe.target.config.to_dict()
    text = {k: v for k, v in config["text_config"].items() if k != "layer_types"}  # drawn again per depth
    text |= {"model_type": language_model, "head_dim": 16, **(MOE if language_model == "qwen3_moe" else {})}
    models = []
    for layers in (4, 2):
        torch.manual_seed(0)
        cfg = InternVLConfig(**{**config, "text_config": {**text, "num_hidden_layers": layers}})
        models.append(InternVLForConditionalGeneration(cfg).eval())
    target, draft = models
    assert (
        type(target.model.language_model).__name__
        == {"qwen3": "Qwen3Model", "qwen3_moe": "Qwen3MoeModel"}[language_model]
    )
    target.model.vision_tower.load_state_dict(pipe.target.model.vision_tower.state_dict())
    target.model.multi_modal_projector.load_state_dict(pipe.target.model.multi_modal_projector.state_dict())
    shape_weights(target, _special_token_ids(pipe.processor.tokenizer, "internvl"), draw_seed=7)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if k in draft.state_dict()})
    for model in (target, draft):
        model.generation_config = pipe.target.generation_config
    qwen3 = VLMSpecPipeline(target, draft, pipe.processor, policy="sage")
    for images, video in (([make_image(7, WIDE), make_image(8)], None), (None, make_video_frames(4))):
        inputs = qwen3.prepare_inputs(images, PROMPTS[4], video)
        out = qwen3(images, PROMPTS[4], video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == qwen3.reference_generate(inputs, MAX_NEW)
        assert out.stats.accepted_tokens > 0
