"""Ovis2 (``Ovis2-1B`` drafting for ``Ovis2-8B``): the tiny ``ovis2`` pair (a ViT tower whose strided patch features
pick rows of a visual embedding table, a Qwen2 language model) is lossless like the other families
(``test_more_families.py``; a Qwen2 language-model draft in ``test_text_drafts.py``). Here, its own ways: a tile's
token count as the real processor writes it, and the indicator tokens around a picture's tiles, which the model embeds
from its visual table, not its text embeddings."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from conftest import language_model_inputs
from transformers import Ovis2Config, Ovis2Processor

from vlmspec import VLMSpecPipeline
from vlmspec.family_builders.chat import OVIS2_INDICATOR_TOKENS
from vlmspec.models.ovis2 import Ovis2Adapter
from vlmspec.testing import build_tiny_pair, make_image


def test_a_tile_holds_the_processor_s_count_of_placeholders():
    """The real geometry (448-pixel tiles of 14-pixel patches, strided 2 x 2): 256 tokens a tile, the count
    ``Ovis2Processor`` writes by default (``image_seq_length``)."""
    config = Ovis2Config(vision_config={"image_size": 448, "patch_size": 14, "hidden_stride": 2})
    adapter = Ovis2Adapter(SimpleNamespace(config=config))
    processor_default = inspect.signature(Ovis2Processor.__init__).parameters["image_seq_length"].default
    assert adapter.block_tokens == (448 // 28) ** 2 == processor_default == 256


def test_the_indicator_tokens_are_embedded_as_the_model_embeds_them(tiny_root):
    """A prompt with a picture cut into tiles holds all five indicators; the language-model inputs the adapter builds
    (what the draft's pruned prefill, a batch's prefill and a conversation's later turns run) are bit for bit those
    the model's own forward builds, and the indicators are not visual tokens (the pruned draft keeps them)."""
    pair = build_tiny_pair("ovis2", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    inputs = pipe.prepare_inputs([make_image(1), make_image(2)], "Compare the two pictures.")
    ids = inputs["input_ids"][0]
    tokenizer = pipe.processor.tokenizer
    for token in OVIS2_INDICATOR_TOKENS:
        assert int((ids == tokenizer.convert_tokens_to_ids(token)).sum()) > 0, f"{token} not in the prompt"
    adapter = Ovis2Adapter(pipe.target)
    assert torch.equal(
        adapter.embed_prompt(inputs)["inputs_embeds"], language_model_inputs(pipe.target, inputs)
    )
    atoms = ids == tokenizer.convert_tokens_to_ids("<IMG_ATOM>")
    assert torch.equal(adapter.prompt_layout(inputs).visual, atoms)
