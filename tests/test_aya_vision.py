"""Aya Vision (``aya-vision-8b`` drafting for ``aya-vision-32b``): the tiny ``aya_vision`` pair (a SigLIP tower of
tiles, 2 x 2 patches shuffled into a token, a Cohere2 language model with sliding-window layers) is lossless like the
other families (``test_more_families.py``). Here, its own ways: a tile's token count as the real processor writes
it, and the real pair's shape, a Cohere2 draft for a target whose Cohere language model has no window."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import torch
from conftest import PROMPTS
from transformers import AyaVisionConfig

from vlmspec import VLMSpecPipeline
from vlmspec.models.aya_vision import AyaVisionAdapter
from vlmspec.testing import build_tiny_pair, make_image


def test_a_tile_holds_the_processor_s_count_of_placeholders():
    """The real geometry (364-pixel tiles of 14-pixel patches, shuffled 2 x 2): 169 tokens a tile, the count
    ``AyaVisionProcessor`` writes with its defaults (``(img_size // patch_size) ** 2``, 364 // 28)."""
    adapter = AyaVisionAdapter(
        SimpleNamespace(config=AyaVisionConfig(vision_config={"image_size": 364, "patch_size": 14}))
    )
    assert adapter.block_tokens == (364 // 28) ** 2 == 169


def test_a_cohere2_draft_drafts_for_a_target_without_a_window(tiny_root, tmp_path):
    """aya-vision-32b's language model is Cohere's (every layer global), the 8B's Cohere2 (three sliding-window
    layers per global one): the tiny target written with a Cohere language model takes the tiny Cohere2 draft, and
    the replies stay ``generate()``'s, past the draft's window."""
    pair = build_tiny_pair("aya_vision", root=tiny_root)
    target = tmp_path / "cohere-target"
    shutil.copytree(pair.target, target)
    config = json.loads((target / "config.json").read_text())
    for key in ("layer_types", "sliding_window"):
        config["text_config"].pop(key)
    config["text_config"]["model_type"] = "cohere"
    (target / "config.json").write_text(json.dumps(config))
    pipe = VLMSpecPipeline.from_pretrained(target, pair.draft, policy="sage", torch_dtype=torch.float32)
    text_types = [type(m.model.language_model).__name__ for m in (pipe.target, pipe.draft)]
    assert text_types == ["CohereModel", "Cohere2Model"]
    accepted = 0
    for image in (make_image(0), [make_image(1), make_image(2)], None):
        inputs = pipe.prepare_inputs(image, PROMPTS[0])
        expected = pipe.reference_generate(inputs, max_new_tokens=48)
        out = pipe(image, PROMPTS[0], max_new_tokens=48)
        assert out.token_ids == expected
        accepted += out.stats.accepted_tokens
    assert accepted > 0
