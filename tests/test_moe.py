"""Mixture-of-experts targets. Qwen3-VL's (Qwen3-VL-30B-A3B's and -235B-A22B's architecture): the tiny
``qwen3_vl_moe`` pair (every layer routes each token to 2 of 4 experts; the draft a truncated copy of the target, so
itself sparse) is lossless like the dense families, alone and in batches, and the dense Qwen3-VL draft drafts for
the sparse target (same tokenizer, vision tower and processor), as Qwen3-VL-2B drafts for Qwen3-VL-30B-A3B. InternVL3.5's (``tiny:internvl_moe``): the same with its own sparse
draft and the dense InternVL draft.

A tree verification routes every node's token on its own, as sequential decoding routes it, so the tree's output is
the target's own; the fixture's router is drawn so that each token's top experts win by clear margins (a router on
near-ties would let the last bits of a batched product flip an expert)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import PROMPTS, input_kinds
from test_batching import check_batch_equals_generate, check_replies_equal_generate, mixed_requests

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.testing import MOE_FAMILIES, build_tiny_pair

POLICIES = ("ar", "chain", "static", "sage", "sage_paper", "eagle2", "pct", "wetap", "c2t")
MAX_NEW = 40


@pytest.fixture(scope="module")
def moe_pair(tiny_root):
    return build_tiny_pair("qwen3_vl_moe", root=tiny_root)


@pytest.fixture(scope="module")
def moe(moe_pair):
    """The sparse pair, and ``generate()``'s reply to every input kind x two prompts."""
    pipe = VLMSpecPipeline.from_pretrained(
        moe_pair.target, moe_pair.draft, policy="ar", torch_dtype=torch.float32
    )
    assert type(pipe.target).__name__ == "Qwen3VLMoeForConditionalGeneration"
    cases = []
    for kind, image, video in input_kinds():
        for prompt in PROMPTS[:2]:
            inputs = pipe.prepare_inputs(image, prompt, video)
            cases.append((kind, prompt, image, video, pipe.reference_generate(inputs, MAX_NEW)))
    return pipe, cases


def test_the_tiny_pair_is_sparse(moe):
    pipe, _ = moe
    assert MOE_FAMILIES == ("qwen3_vl_moe", "internvl_moe")
    for model in (pipe.target, pipe.draft):
        text = model.config.get_text_config()
        assert (text.num_experts, text.num_experts_per_tok, text.mlp_only_layers) == (4, 2, [])
        assert all(hasattr(layer.mlp, "experts") for layer in model.model.language_model.layers)


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate_on_a_sparse_target(moe, policy):
    pipe, cases = moe
    calls = [
        (
            f"{kind}/{prompt!r}",
            {"image": image, "prompt": prompt, "video": video, "max_new_tokens": MAX_NEW},
            expected,
        )
        for kind, prompt, image, video, expected in cases
    ]
    check_replies_equal_generate(
        pipe, policy, calls
    )  # the sparse draft's proposals were accepted and checked


@pytest.mark.parametrize("policy", ["chain", "sage", "eagle2"])
def test_a_batch_on_a_sparse_target_equals_each_request_s_generate(moe, policy):
    pipe, _ = moe
    pipe.policy = get_policy(policy)
    check_batch_equals_generate(pipe, mixed_requests(), policy)


def test_the_dense_qwen3_vl_draft_drafts_for_the_sparse_target(moe_pair, tiny_pairs, moe):
    _, cases = moe
    dense = tiny_pairs["qwen3_vl"]
    pipe = VLMSpecPipeline.from_pretrained(
        moe_pair.target, dense.draft, policy="sage", torch_dtype=torch.float32
    )
    assert type(pipe.draft).__name__ == "Qwen3VLForConditionalGeneration"
    for kind, prompt, image, video, expected in cases:
        out = pipe(image, prompt, video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == expected, f"dense draft/{kind}/{prompt!r}"


def test_a_draft_of_another_series_is_still_refused(moe_pair, tiny_pairs):
    with pytest.raises(
        InvalidInputError, match="the draft model is a 'qwen2_vl' model but the target is 'qwen3_vl_moe'"
    ):
        VLMSpecPipeline.from_pretrained(moe_pair.target, tiny_pairs["qwen2_vl"].draft, policy="chain")


def test_an_edd_draft_for_a_sparse_target_is_lossless(moe):
    """An EDD draft built for the sparse target (one decoder layer of the target's own kind, a sparse one, reading
    its hidden states): untrained, its proposals are mostly rejected, and the reply stays the target's."""
    from vlmspec.models import EDDDraft

    pipe, cases = moe
    edd = VLMSpecPipeline(
        pipe.target, EDDDraft.for_target(pipe.target), pipe.processor, policy="chain", gamma=3
    )
    for kind, prompt, image, video, expected in cases:
        assert edd(image, prompt, video=video, max_new_tokens=MAX_NEW).token_ids == expected, f"edd/{kind}"


def test_a_checkpoint_that_asks_for_router_logits_still_verifies_trees(moe):
    """``output_router_logits: true`` in a checkpoint's config (training recipes set it) would make the forward
    compute the load-balancing loss over the tree's 4-D mask; the engine's calls turn it off, and the reply is the
    target's own."""
    pipe, cases = moe
    text = pipe.target.config.get_text_config()
    pipe.policy = get_policy("sage")
    text.output_router_logits = True
    try:
        for kind, prompt, image, video, expected in cases[:4]:
            assert pipe(image, prompt, video=video, max_new_tokens=MAX_NEW).token_ids == expected, kind
    finally:
        text.output_router_logits = False


@pytest.mark.parametrize(("dense_layers", "step"), [([3], 1), ([], 2), ([0], 1)])
def test_an_edd_draft_copies_a_dense_or_a_sparse_layer_as_it_finds_it(moe, dense_layers, step):
    """Targets whose layers are not all sparse (``mlp_only_layers`` names dense ones, ``decoder_sparse_step`` spaces
    the sparse ones): the EDD draft's one layer is of the kind of the target layer it is copied from (layer 3 of 4
    here), so the copied weights fit, and the reply stays the target's."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vlmspec.models import EDDDraft

    pipe, cases = moe
    config = copy.deepcopy(pipe.target.config)
    config.text_config.mlp_only_layers, config.text_config.decoder_sparse_step = dense_layers, step
    torch.manual_seed(0)
    target = Qwen3VLMoeForConditionalGeneration(config).eval()
    target.load_state_dict(
        pipe.target.state_dict(), strict=False
    )  # what both shapes share; the rest as drawn
    target.generation_config = pipe.target.generation_config
    edd = EDDDraft.for_target(target, hidden_layer=2)
    copied_is_dense = 3 in dense_layers or (3 + 1) % step != 0
    assert hasattr(edd.decoder.layers[0].mlp, "experts") is not copied_is_dense
    assert hasattr(target.model.language_model.layers[3].mlp, "experts") is not copied_is_dense
    spec = VLMSpecPipeline(target, edd, pipe.processor, policy="chain", gamma=3)
    kind, prompt, image, video, _ = cases[0]
    inputs = spec.prepare_inputs(image, prompt, video)
    assert spec(image, prompt, video=video, max_new_tokens=24).token_ids == spec.reference_generate(
        inputs, 24
    )


def test_internvl3_5_s_sparse_target_takes_its_sparse_and_its_dense_drafts(tiny_root, tiny_pairs):
    """InternVL3.5-30B-A3B's architecture (model type ``internvl``, a sparse Qwen3 language model behind InternVL's
    tiles): lossless with its own sparse draft, whose proposals are accepted, and with the dense ``tiny:internvl``
    draft (same tokenizer, tower and processor), as InternVL3.5-2B drafts for the 30B-A3B."""
    sparse = build_tiny_pair("internvl_moe", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(
        sparse.target, sparse.draft, policy="ar", torch_dtype=torch.float32
    )
    assert type(pipe.target.model.language_model).__name__ == "Qwen3MoeModel"
    calls = []
    for kind, image, video in input_kinds():
        call = {"image": image, "prompt": PROMPTS[0], "video": video, "max_new_tokens": MAX_NEW}
        expected = pipe.reference_generate(pipe.prepare_inputs(image, PROMPTS[0], video), MAX_NEW)
        calls.append((f"internvl_moe/{kind}", call, expected))
    for policy in ("chain", "sage"):
        check_replies_equal_generate(pipe, policy, calls)
    dense = VLMSpecPipeline.from_pretrained(
        sparse.target, tiny_pairs["internvl"].draft, policy="sage", torch_dtype=torch.float32
    )
    assert type(dense.draft.model.language_model).__name__ == "Qwen2Model"
    for label, call, expected in calls:
        assert dense(**call).token_ids == expected, f"dense draft/{label}"
