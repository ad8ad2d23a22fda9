"""A Gemma 4 assistant drafting for the tiny ``gemma4`` target (``build_tiny_assistant``): it keeps no cache, reads
the target's keys and last state, and drafts each node from its parent's returned state
(:mod:`vlmspec.models.gemma4_assistant`, :class:`vlmspec.draft.MTPDraftTree`). Lossless for every tree policy,
greedy and sampled, alone, in a batch and in a conversation; its first drafts are those transformers' own candidate
generator makes; a pipeline with it saves and loads; an assistant for another target is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    PROMPTS,
    check_a_conversation_with_pictures_equals_generate,
    check_the_second_token_follows_the_target,
)
from test_batching import check_a_sampled_reply_is_the_same_alone_and_at_batch_3, mixed_requests, reference

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.draft import MTPDraftTree
from vlmspec.testing import build_tiny_assistant, build_tiny_pair, make_image, make_video_frames

POLICIES = ("chain", "static", "sage", "eagle2")
CALLS = (
    {"image": make_image(0), "prompt": PROMPTS[0]},
    {"video": make_video_frames(3), "prompt": PROMPTS[2]},
    {"prompt": PROMPTS[3]},
)


@pytest.fixture(scope="module")
def assisted(tiny_root):
    pair = build_tiny_pair("gemma4", root=tiny_root)
    draft = build_tiny_assistant(root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, draft, policy="sage", torch_dtype=torch.float32)
    references = [
        pipe.reference_generate(pipe.prepare_inputs(c.get("image"), c["prompt"], video=c.get("video")), 32)
        for c in CALLS
    ]
    return pipe, references


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate(assisted, policy):
    pipe, references = assisted
    pipe.policy = get_policy(policy)
    accepted = 0
    for call, expected in zip(CALLS, references, strict=True):
        out = pipe(**call, max_new_tokens=32)
        assert out.token_ids == expected, (policy, call["prompt"])
        assert out.stats.draft_visual_tokens == 0  # it reads the prompt only through the target's keys
        accepted += out.stats.accepted_tokens
    assert accepted > 0


def test_the_first_drafts_are_transformers_own(assisted):
    """After the prefill, a chain of four drafted tokens and their distributions equal transformers' multi-token
    candidate generator's (the one ``generate(assistant_model=...)`` runs): same inputs, keys, position and state."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    pipe, _ = assisted
    inputs = pipe.prepare_inputs(make_image(0), PROMPTS[0])
    with torch.no_grad():
        out = pipe.target(**inputs, output_hidden_states=True, return_shared_kv_states=True)
    root = out.logits[0, -1].argmax()
    ids = torch.cat([inputs["input_ids"], root.reshape(1, 1)], dim=1)
    config = GenerationConfig(max_length=ids.shape[1] + 8)
    pipe.draft.generation_config.num_assistant_tokens = 4
    generator = SinglePositionMultiTokenCandidateGenerator(
        pipe.draft, pipe.target.get_input_embeddings(), config
    )
    candidates, logits = generator.get_candidates(ids, {}, out, is_first_iteration=False, n_last_matches=0)

    target, draft = pipe.target_adapter, pipe.draft_adapter
    prefill = target.prefill(inputs, hidden_layer=draft.reads_target_layer)
    state = draft.prefill_soft(
        prefill.hidden, prefill.position_ids, prefill.state.rope_delta, target=prefill.state
    )
    empty = prefill.hidden.new_zeros(0, prefill.hidden.shape[-1])
    tree = MTPDraftTree(draft, state, root, inputs["input_ids"].shape[1], empty, depth_limit=4)
    node, drafted, probs = torch.zeros(1, dtype=torch.long), [], []
    for _ in range(4):
        p = tree.next_probs(node)  # [1, V]
        token = p.argmax(-1)
        node = tree.add(node, token, p[0, token])
        drafted.append(int(token))
        probs.append(p[0])
    assert drafted == candidates[0, ids.shape[1] :].tolist()
    torch.testing.assert_close(torch.stack(probs), torch.softmax(logits[0].float(), -1), atol=1e-5, rtol=1e-4)

    # A level of three children in one forward: each as transformers drafts it alone after the root
    tree = MTPDraftTree(draft, state, root, inputs["input_ids"].shape[1], empty, depth_limit=4)
    first = tree.next_probs(torch.zeros(1, dtype=torch.long))
    children = tree.add(torch.zeros(3, dtype=torch.long), first[0].topk(3).indices, first[0].topk(3).values)
    level = tree.next_probs(children)  # [3, V]
    keys = {
        k: (v[0][:, :, : ids.shape[1] - 1], v[1][:, :, : ids.shape[1] - 1])
        for k, v in out.shared_kv_states.items()
    }
    position = torch.tensor([[ids.shape[1] - 1]])

    def alone(token, state):
        rows = torch.cat([pipe.target.get_input_embeddings()(token.reshape(1, 1)), state], dim=-1)
        with torch.no_grad():
            result = pipe.draft(inputs_embeds=rows, position_ids=position, shared_kv_states=keys)
        return torch.softmax(result.logits[0, -1].float(), -1), result.last_hidden_state

    _, root_state = alone(root, out.hidden_states[-1][:, -1:])
    for child, probs in zip(first[0].topk(3).indices, level, strict=True):
        torch.testing.assert_close(probs, alone(child, root_state)[0], atol=1e-5, rtol=1e-4)


def test_a_batch_of_mixed_requests_equals_each_request_s_generate(assisted):
    """At batch 3 every reply is the request's own ``generate()``, and the requests' assistant steps are merged: one
    forward a level for the rows drafting together, far fewer forwards than the same requests one at a time."""
    pipe, _ = assisted
    pipe.policy = get_policy("sage")
    requests = mixed_requests()[:6]
    forwards, counts = [], {}
    handle = pipe.draft.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        for batch_size in (1, 3):
            forwards.clear()
            outs = pipe.batch(requests, batch_size=batch_size)
            for i, (request, out) in enumerate(zip(requests, outs, strict=True)):
                assert out.token_ids == reference(pipe, request), (batch_size, i)
            counts[batch_size] = len(forwards)
    finally:
        handle.remove()
    assert counts[3] < 0.6 * counts[1], counts


def test_a_sampled_reply_is_the_same_alone_and_in_a_batch(tiny_root):
    """With the tree's sizes and prices set (automatic ones are refitted per batch size), the same seed gives the
    same sampled reply alone and at batch 3, where the requests' assistant steps share forwards."""
    pair = build_tiny_pair("gemma4", root=tiny_root)
    check_a_sampled_reply_is_the_same_alone_and_at_batch_3(pair.target, build_tiny_assistant(root=tiny_root))


def test_a_conversation_equals_generate(assisted):
    check_a_conversation_with_pictures_equals_generate(assisted[0])


def test_sampling_follows_the_target(assisted):
    pipe, _ = assisted
    pipe.policy = get_policy("sage")
    check_the_second_token_follows_the_target(pipe, draws=250)


def test_a_pipeline_with_it_saves_and_loads(assisted, tmp_path):
    pipe, references = assisted
    loaded = VLMSpecPipeline.from_pretrained(
        pipe.save_pretrained(tmp_path / "saved"), torch_dtype=torch.float32
    )
    assert type(loaded.draft_adapter) is type(pipe.draft_adapter)
    assert loaded(**CALLS[0], max_new_tokens=32).token_ids == references[0]


def test_an_assistant_for_another_target_is_refused(tiny_root):
    qwen = build_tiny_pair("qwen2_vl", root=tiny_root)
    with pytest.raises(InvalidInputError, match=r"'gemma4_assistant' draft drafts for 'gemma4' targets, not"):
        VLMSpecPipeline.from_pretrained(qwen.target, build_tiny_assistant(root=tiny_root))


def test_the_bench_times_its_forwards_as_draft_forwards(assisted):
    """The bench's forward recorder sees each assistant forward as a draft forward of its nodes, never as a prefill
    (the assistant keeps no cache, so none of its forwards starts one)."""
    from vlmspec_eval.methods import ForwardRecorder

    pipe, _ = assisted
    pipe.policy = get_policy("static")
    recorder = ForwardRecorder(pipe.target, pipe.draft)
    with recorder.recording():
        pipe(**CALLS[0], max_new_tokens=8)
    drafts = [call for call in recorder.calls if call.role == "draft"]
    assert drafts and not any(call.prefill for call in drafts)
    assert max(call.tokens for call in drafts) > 1  # a level of several nodes, one forward
