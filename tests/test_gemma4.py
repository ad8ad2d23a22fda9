"""Gemma 4 (``gemma-4-E4B-it`` drafting for ``gemma-4-31B-it`` or ``-26B-A4B-it``): the tiny ``gemma4`` pair
(per-layer inputs, last layers reusing earlier layers' keys, global layers with wider heads and fewer of them, a
picture's tokens read both ways in the local layers) is lossless like the other families (``test_more_families.py``). Here, its own ways: the
per-layer inputs vlmspec hands the model (it never makes the model recover token ids from embeddings), pictures and
frames whose token counts follow their sizes, a cache of layers of two shapes, a sparse target (26B-A4B's routed
experts) drafted for by the dense draft."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts, language_model_kwargs
from test_batching import check_batch_equals_generate, mixed_requests

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.models import EDDDraft
from vlmspec.models.gemma4 import Gemma4Adapter
from vlmspec.testing import build_tiny_pair, make_image, make_video_frames

_MEDIA_KEYS = (
    "pixel_values",
    "image_position_ids",
    "pixel_values_videos",
    "video_position_ids",
    "num_frames_per_video",
)
WIDE = (90, 30)  # (width, height): resized to 112 x 32 pixels, 56 tokens (a square picture: 64)


@pytest.fixture(scope="module")
def gemma4(tiny_root):
    pair = build_tiny_pair("gemma4", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_a_prompt_s_inputs_are_the_model_s_own(gemma4):
    """Pictures of two sizes and a video: the language-model inputs the adapter builds (the pruned draft's prefill, a
    batch's, a conversation's later turns) are the model's own, per-layer inputs included (placeholders read as
    padding), and each picture's and frame's token count follows its size."""
    pipe = gemma4
    inputs = pipe.prepare_inputs(
        [make_image(1), make_image(2, size=WIDE)], PROMPTS[0], video=make_video_frames(3)
    )
    adapter = Gemma4Adapter(pipe.target)
    built, own = adapter.embed_prompt(inputs), language_model_kwargs(pipe.target, inputs)
    assert torch.equal(built["inputs_embeds"], own["inputs_embeds"])
    assert torch.equal(built["per_layer_inputs"], own["per_layer_inputs"])
    pictures = adapter._tokens_per_item(inputs["image_position_ids"]).tolist()
    assert pictures == [64, 56]
    frames = adapter._tokens_per_item(inputs["video_position_ids"])
    ids = inputs["input_ids"][0]
    assert int((ids == pipe.target.config.image_token_id).sum()) == sum(pictures)
    assert int((ids == pipe.target.config.video_token_id).sum()) == int(frames.sum())


def test_no_forward_makes_the_model_recover_token_ids(gemma4, monkeypatch):
    """The model reads per-layer inputs by token id; given embeddings alone it would compare them with every row of
    its embedding table (gigabytes at Gemma 4's vocabulary). vlmspec hands it the per-layer inputs in every forward:
    full, pruned and batched prefills, the pruning probe's side pass, tree verification and drafting."""
    text_model = type(gemma4.target.model.language_model)
    lookup = text_model.get_per_layer_inputs
    calls: list[bool] = []

    def checked(self, input_ids, inputs_embeds=None):
        calls.append(input_ids is not None)
        return lookup(self, input_ids, inputs_embeds)

    monkeypatch.setattr(text_model, "get_per_layer_inputs", checked)
    requests = [
        {"image": make_image(0), "prompt": PROMPTS[0], "prune_ratio": 0.5, "max_new_tokens": 12},
        {"video": make_video_frames(3), "prompt": PROMPTS[2], "prune_ratio": 0.5, "max_new_tokens": 12},
    ]
    assert gemma4.pruning.method == "attention"  # the probe's side pass runs
    for out in [
        *gemma4.batch(requests, batch_size=2),
        gemma4(**requests[0]),
    ]:  # batched prefills, then the model's
        assert len(out.token_ids) == 12 and out.stats.accepted_tokens > 0
        assert out.stats.draft_visual_tokens == out.stats.target_visual_tokens // 2
    assert calls and all(calls)  # the model's own prefill looks up ids; nothing asks without them


def test_a_padded_processor_batch_splits_into_each_prompt_s_media(gemma4):
    """Pictures of different sizes, a video and a text prompt in one processor batch: each row gets its own pixels,
    patch positions and frames, as the processor gives them for that prompt alone, and its reply is that prompt's
    ``generate()``."""
    prompts = [
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[2]}], [], make_video_frames(3)),
        (
            [{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[0]}],
            [make_image(1), make_image(2, size=WIDE)],
            None,
        ),
        ([{"type": "text", "text": PROMPTS[3]}], [], None),
        ([{"type": "image"}, {"type": "text", "text": PROMPTS[1]}], [make_image(4, size=WIDE)], None),
    ]

    def same_media(row, alone, b):
        for key in _MEDIA_KEYS:
            assert (key in row) == (key in alone), (b, key)
            if key in alone:
                assert torch.equal(row[key], alone[key]), (b, key)

    check_a_padded_batch_splits_into_its_prompts(gemma4, prompts, same_media, nested_images=True)


def test_an_edd_draft_is_refused_naming_why(gemma4):
    with pytest.raises(
        InvalidInputError, match=r"'gemma4' target: its layers read per-layer inputs.*gemma-4-E2B"
    ):
        EDDDraft.for_target(gemma4.target)


def test_a_sparse_target_of_26b_a4b_s_kind_takes_the_dense_draft(tiny_root, tmp_path):
    """Gemma 4 26B-A4B's decoder layers each add a routed block of experts beside the dense MLP
    (``enable_moe_block``): the tiny target rewritten so (4 experts, 2 a token, drawn as it loads), drafted for by the
    dense tiny draft, replies as ``generate()`` under every tree policy, alone and in a batch of mixed requests."""
    pair = build_tiny_pair("gemma4", root=tiny_root)
    target = tmp_path / "sparse-target"
    shutil.copytree(pair.target, target)
    config = json.loads((target / "config.json").read_text())
    config["text_config"] |= {
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 64,
    }
    (target / "config.json").write_text(json.dumps(config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the experts' draw
        pipe = VLMSpecPipeline.from_pretrained(target, pair.draft, policy="sage", torch_dtype=torch.float32)
    assert all(layer.enable_moe_block for layer in pipe.target.model.language_model.layers)
    dense = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    inputs = pipe.prepare_inputs(make_image(0), PROMPTS[0])
    assert pipe.reference_generate(inputs, 32) != dense.reference_generate(inputs, 32)  # the experts count
    for policy in ("chain", "static", "sage", "eagle2"):
        pipe.policy = get_policy(policy)
        for media in ({"image": make_image(0)}, {"video": make_video_frames(3)}, {}):
            inputs = pipe.prepare_inputs(media.get("image"), PROMPTS[0], video=media.get("video"))
            out = pipe(prompt=PROMPTS[0], max_new_tokens=32, **media)
            assert out.token_ids == pipe.reference_generate(inputs, 32), (policy, list(media))
    check_batch_equals_generate(pipe, mixed_requests()[:6], "sparse gemma4")
