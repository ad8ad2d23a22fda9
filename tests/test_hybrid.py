"""The families whose language models have recurrent layers beside their attention layers, verified over trees:
Qwen3.5 (Gated DeltaNet), LFM2-VL and LFM3-VL (short convolutions). Their tiny pairs (every second layer attends)
are in ``test_more_families.py``'s matrix (every policy, a pruned draft, batches, a conversation). Here, what they
share: a tree's forward gives every path transformers' own logits, token by token, and keeping a path leaves the
recurrent states ``generate()`` has there; the visual scores of the draft's pruning are the attention layers' own;
sampling follows the target and does not depend on the batch, and a forward reads the host once (for one family per
kind of recurrent layer); an EDD draft reads transformers' hidden states, alone, at batch 3 and in a conversation.
What only one family has is in its own file (``test_qwen3_5.py``, ``test_lfm2_vl.py``, ``test_lfm3_vl.py``).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    check_a_conversation_with_pictures_equals_generate,
    check_the_second_token_follows_the_target,
)
from test_batching import check_a_sampled_reply_is_the_same_alone_and_at_batch_3, mixed_requests, reference
from test_host_syncs import CPU_LIKE, END_OF_GENERATION, PER_DRAFT_FORWARD, PER_STEP
from transformers import AutoModelForImageTextToText

from vlmspec import VLMSpecPipeline
from vlmspec.cache import keep_tail
from vlmspec.host_syncs import HostSyncCounter
from vlmspec.models import EDDDraft, adapter_for
from vlmspec.testing import HYBRID_FAMILIES, build_tiny_pair, input_kinds, make_inputs
from vlmspec.tree import ancestor_matrix, tree_attention_bias

PARENTS = [-1, 0, 0, 1, 1, 3, 2]
"""The verified tree: the root, then the greedy path at nodes 1, 3, 5 and three other branches (2, 4, 6)."""
PATH = [0, 1, 3, 5]
LAYER_KINDS = ("qwen3_5", "lfm2_vl")
"""One family per kind of recurrent layer (Gated DeltaNet, short convolutions) for what runs the same whatever the
family around it (sampling, a batch's store, host reads): LFM3-VL runs LFM2's layers (with its norms), MiniCPM-V
Qwen3.5's."""


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def pair(request, tiny_root):
    return build_tiny_pair(request.param, root=tiny_root)


@pytest.fixture(scope="module")
def pipe(pair):
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def check_a_tree_decodes_as_generate(model: torch.nn.Module, inputs: dict) -> None:
    """One forward over a tree gives the greedy path's nodes ``generate()``'s logits, and once the path is kept the
    next forward gives the next step's: the recurrent states kept are the ones ``generate()`` reached."""
    length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        ref = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    greedy, expected = ref.sequences[0, length:], torch.stack(ref.logits)[:, 0]  # [6], [6, V]
    adapter = adapter_for(model)
    prefill = adapter.prefill(inputs)
    state = prefill.state
    torch.testing.assert_close(prefill.logits, expected[0], rtol=1e-4, atol=1e-4)
    vocab = expected.shape[-1]
    others = (greedy + 1) % vocab  # tokens off the greedy path
    tokens = torch.stack([greedy[0], greedy[1], others[1], greedy[2], others[2], greedy[3], others[2]])
    ancestors = ancestor_matrix(torch.tensor(PARENTS))
    depths = ancestors.sum(1) - 1
    past = state.length
    bias = tree_attention_bias(ancestors, past, adapter.dtype)
    logits = adapter.forward(state, tokens, length + depths, bias)  # [7, V]
    torch.testing.assert_close(logits[PATH], expected[1:5], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[2], expected[1], atol=1e-3)  # a branch off the path sees its own prefix
    keep_tail(state.cache, past, past + torch.tensor(PATH))
    assert state.length == past + len(PATH)
    one = tree_attention_bias(torch.ones(1, 1, dtype=torch.bool), state.length, adapter.dtype)
    again = adapter.forward(state, greedy[4:5], torch.tensor([length + 4]), one)  # the token after the path
    torch.testing.assert_close(again[0], expected[5], rtol=1e-4, atol=1e-4)


def test_a_tree_decodes_as_generate(pair, pipe):
    """For every input kind the family takes (a video's prompt runs past LFM3-VL's local window: ``test_lfm3_vl.py``)."""
    for kind in input_kinds(pair.family):
        check_a_tree_decodes_as_generate(pipe.target, make_inputs(pipe.processor, kind))


def test_visual_scores_are_the_attention_layers_own(pair, pipe):
    """The draft's attention-guided pruning reads what the text after the last visual token pays to each visual
    token: here taken from each attention layer run again on its kept input (no side pass, which would cut the
    recurrent states back); equal to the weights the model's own eager forward returns, averaged over the
    attention layers, heads and those queries."""
    inputs = make_inputs(pipe.processor, "image")
    scores = adapter_for(pipe.target).prefill(inputs, score_visual=True).visual_scores
    eager = AutoModelForImageTextToText.from_pretrained(
        pair.target, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        attentions = eager(**inputs, output_attentions=True).attentions  # the attention layers' [1, H, L, L]
    visual = (inputs["input_ids"][0] == pipe.target.config.image_token_id).nonzero().flatten()
    split = int(visual[-1]) + 1
    weights = torch.stack([layer[0, :, split:][..., visual] for layer in attentions if layer is not None])
    assert len(weights) == 2 and scores.shape == visual.shape
    torch.testing.assert_close(scores, weights.float().mean(dim=(0, 1, 2)), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", LAYER_KINDS)
def test_sampling_follows_the_target(family, tiny_root):
    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    check_the_second_token_follows_the_target(pipe, draws=200)


@pytest.mark.parametrize("family", LAYER_KINDS)
def test_a_sampled_reply_is_the_same_alone_and_in_a_batch(family, tiny_root):
    """The requests' recurrent states sit in one store at batch 3."""
    pair = build_tiny_pair(family, root=tiny_root)
    check_a_sampled_reply_is_the_same_alone_and_at_batch_3(pair.target, pair.draft)


def test_an_edd_draft_reads_the_hidden_states_transformers_computes(pair, pipe):
    """An EDD draft of a hybrid target: its one layer is an attention layer (the nearest after the one it reads), and
    the hidden states it reads, in the prompt's prefill (transformers' forward) and in a decoding forward (the
    written-out decoder, which calls no layer module), are the ones transformers' own forward computes there."""
    target = pipe.target
    draft = EDDDraft.for_target(target)
    layer = draft.edd_config.hidden_layer
    text = target.get_decoder()
    assert draft.config.layer_types[0] in ("full_attention", "sliding_attention")
    assert any(not hasattr(m, "self_attn") for m in text.layers)  # the target does have recurrent layers
    inputs = make_inputs(pipe.processor, "image")
    adapter = adapter_for(target)
    prefill = adapter.prefill(inputs, hidden_layer=layer)
    tokens = torch.tensor([11, 12, 13])
    length = inputs["input_ids"].shape[1]
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    bias = tree_attention_bias(causal, prefill.state.length, adapter.dtype)
    _, decoded = adapter.forward_hidden(prefill.state, tokens, torch.arange(length, length + 3), bias, layer)
    longer = dict(inputs, input_ids=torch.cat([inputs["input_ids"], tokens[None]], 1))
    longer["attention_mask"] = torch.ones_like(longer["input_ids"])
    if "mm_token_type_ids" in inputs:
        longer["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(tokens)[None]], 1
        )
    with torch.inference_mode():
        expected = target(**longer, output_hidden_states=True).hidden_states[layer + 1][0]  # [L + 3, D]
    torch.testing.assert_close(prefill.hidden, expected[:length], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decoded, expected[length:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", LAYER_KINDS)
def test_an_edd_draft_at_batch_size_3_and_in_a_conversation_equals_generate(family, tiny_root):
    """Each request's soft prompt and pending rows come from its own row of the target's batched forwards; a
    conversation's later turns extend the draft's soft prompt with the target's states of the new prompt."""
    pair = build_tiny_pair(family, root=tiny_root)
    base = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    pipe = VLMSpecPipeline(base.target, EDDDraft.for_target(base.target), base.processor, policy="sage")
    requests = mixed_requests()[:6]
    outputs = pipe.batch(requests, batch_size=3)
    assert [o.token_ids for o in outputs] == [reference(pipe, r) for r in requests]
    assert sum(o.stats.accepted_tokens for o in outputs) > 0
    check_a_conversation_with_pictures_equals_generate(pipe)


@pytest.mark.parametrize("policy", ["chain", "static", "sage"])
@pytest.mark.parametrize("family", LAYER_KINDS)
def test_a_forward_adds_one_host_read(family, policy, tiny_root):
    """A hybrid model's forward reads its entries' levels once (the recurrence runs a level at a time): a step's
    budget (``test_host_syncs.py``) plus one read per target and draft forward, nothing else."""
    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy=policy, torch_dtype=torch.float32)
    pipe.costs = CPU_LIKE
    forwards = []
    head = pipe.draft.get_output_embeddings()  # the decoder is run layer by layer: the head ends each forward
    head.register_forward_hook(lambda *_: forwards.append(1))
    image = make_inputs(pipe.processor, "image")
    with HostSyncCounter() as prefill:  # the prefills and the first token: no decoding step
        pipe(inputs=image, max_new_tokens=1)
    prefill_forwards = len(forwards)
    with HostSyncCounter() as run:
        out = pipe(inputs=image, max_new_tokens=40)
    draft_forwards = len(forwards) - 2 * prefill_forwards
    decode = run.total - prefill.total
    per_step = PER_STEP[policy] * out.stats.steps + PER_DRAFT_FORWARD.get(policy, 0) * draft_forwards
    assert out.stats.steps > 0 and decode <= per_step + out.stats.steps + draft_forwards + END_OF_GENERATION
