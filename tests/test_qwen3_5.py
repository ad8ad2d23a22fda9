"""Qwen3.5: a hybrid language model (Gated DeltaNet recurrent layers beside attention layers) verified over trees.

The tiny pair (``tiny:qwen3_5``: every second layer attends) is in ``test_more_families.py``'s matrix (every policy,
a pruned draft, batches, a conversation) and ``test_hybrid.py``'s (a tree's paths, the visual scores, sampling,
EDD refused, host reads). Here: what only this family has. A tree decodes as ``generate()`` with the last layer
recurrent and with routed experts (Qwen3.5-MoE).
"""

from __future__ import annotations

import pytest
import torch
from test_hybrid import check_a_tree_decodes_as_generate
from transformers import AutoModelForImageTextToText, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig

from vlmspec import VLMSpecPipeline
from vlmspec.testing import build_tiny_pair, make_inputs


@pytest.fixture(scope="module")
def pipe(tiny_root):
    pair = build_tiny_pair("qwen3_5", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def _variant(pipe, **text: object) -> tuple[torch.nn.Module, dict]:
    """A randomly initialised model of the tiny target's shapes with ``text`` config changes, and a picture's
    inputs."""
    config = pipe.target.config.to_dict()
    config["text_config"] |= text
    torch.manual_seed(0)
    if "num_experts" in text:
        config.pop("model_type")
        model = AutoModelForImageTextToText.from_config(Qwen3_5MoeConfig(**config))
    else:
        model = Qwen3_5ForConditionalGeneration(type(pipe.target.config)(**config))
    return model.eval(), make_inputs(pipe.processor, "image")


def test_the_last_layer_may_be_recurrent(pipe):
    """A forward's entries count once the last attention layer wrote them, wherever it lies."""
    layers = ["full_attention", "linear_attention", "full_attention", "linear_attention"]
    check_a_tree_decodes_as_generate(*_variant(pipe, layer_types=layers))


def test_qwen3_5_moe_routed_experts(pipe):
    """Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B): every layer's MLP routes each token to 2 of 4 experts beside a
    shared one."""
    model, inputs = _variant(
        pipe,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    assert model.config.model_type == "qwen3_5_moe"
    check_a_tree_decodes_as_generate(model, inputs)
