"""LFM3-VL (``LiquidAI/LFM3-VL-2B``): Qwen2-VL's flat patches read by LFM3-VL's own tower, in front of LFM3, a hybrid
language model of 7-wide short convolutions (recurrent layers), local (sliding-window) and global attention layers
with their own rotary tables, sandwich norms and 1-D positions, verified over trees.

The tiny pair (``tiny:lfm3_vl``: a convolution, a local layer of a 24-token window, a convolution, a global layer) is
in ``test_more_families.py``'s matrix (every policy, a pruned draft, batches, a conversation, EDD refused). Here, what
only this family has: a tree's forward gives every path transformers' own logits (its windows past the prompt's
start in a video's prompt, a path's convolution window reaching back into the committed inputs), keeping a path
leaves what ``generate()`` has there; the draft's visual scores; sampling.
"""

from __future__ import annotations

import pytest
import torch
from conftest import check_the_second_token_follows_the_target
from test_batching import check_a_sampled_reply_is_the_same_alone_and_at_batch_3
from test_qwen3_5 import (
    check_a_forward_adds_one_host_read,
    check_a_tree_decodes_as_generate,
    check_the_visual_scores_are_the_attention_layers_own,
)

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.models import EDDDraft
from vlmspec.testing import build_tiny_pair, make_inputs


@pytest.fixture(scope="module")
def pair(tiny_root):
    return build_tiny_pair("lfm3_vl", root=tiny_root)


@pytest.fixture(scope="module")
def pipe(pair):
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_the_fixture_has_every_kind_of_layer(pipe):
    text = pipe.target.config.text_config
    assert text.layer_types == ["conv", "sliding_attention", "conv", "full_attention"]
    assert text.sliding_window == 24 and text.conv_L_cache == 7


@pytest.mark.parametrize("kind", ["image", "video", "text"])
def test_a_tree_decodes_as_generate(pipe, kind):
    """A video's prompt (41 tokens) is longer than the local layers' window: the tree's queries see the keys inside
    their windows only, as ``generate()``'s."""
    inputs = make_inputs(pipe.processor, kind)
    if kind == "video":
        assert inputs["input_ids"].shape[1] > pipe.target.config.text_config.sliding_window
    check_a_tree_decodes_as_generate(pipe.target, inputs)


def test_visual_scores_are_the_attention_layers_own(pair, pipe):
    check_the_visual_scores_are_the_attention_layers_own(pair, pipe)


def test_sampling_follows_the_target(pipe):
    pipe.policy = get_policy("sage")
    check_the_second_token_follows_the_target(pipe, draws=200)


def test_a_sampled_reply_is_the_same_alone_and_in_a_batch(pair):
    check_a_sampled_reply_is_the_same_alone_and_at_batch_3(pair.target, pair.draft)


def test_an_edd_draft_is_refused(pipe):
    with pytest.raises(InvalidInputError, match=r"cannot be built for a 'lfm3_vl' target: .*convolutions"):
        EDDDraft.for_target(pipe.target)


@pytest.mark.parametrize("policy", ["chain", "sage"])
def test_a_forward_adds_one_host_read(pair, policy):
    check_a_forward_adds_one_host_read(pair, policy)
