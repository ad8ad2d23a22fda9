"""The families tested outside the main lossless matrix (``tests/test_lossless.py``), each with ways of its own:
Gemma 3 (local layers, pictures only), LLaVA-1.5 and LLaVA-NeXT (pictures only; NeXT's anyres grids), Janus and
DeepSeek-VL (pictures only; the 7B's hybrid tower reads them twice) and SmolVLM2
(tiles; a video's frames as tiles), Gemma 4 (per-layer inputs, layers reusing keys), Perception LM (timm's tower,
pictures cut into tiles, a video's frames a tile each), Qwen3.5, LFM2-VL and LFM3-VL (recurrent layers). Every one is lossless
with plain decoding, a chain and SAGE's trees (each kind of verification; every policy runs in the main matrix),
with a pruned draft, with an EDD draft (Gemma 4 refuses one, saying why), in batches of mixed requests and in a conversation; what only one family has is tested in its own file
(``test_gemma3.py``, ``test_llava.py``, ``test_smolvlm.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_conversation_with_pictures_equals_generate
from test_batching import (
    check_a_pruned_draft_keeps_the_replies,
    check_batch_equals_generate,
    check_replies_equal_generate,
    mixed_requests,
)

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.models import EDDDraft
from vlmspec.testing import (
    IMAGE_ONLY_FAMILIES,
    OWN_TEST_FAMILIES,
    build_tiny_pair,
    input_kinds,
    make_image,
    make_video_frames,
)

FAMILIES = (*IMAGE_ONLY_FAMILIES, *OWN_TEST_FAMILIES)
POLICIES = ("ar", "chain", "sage")
"""Every kind of tree a family's forwards meet: none, a chain, a fixed tree and SAGE's, which grows level by level
(every policy on every input kind is the main matrix's, ``test_lossless.py`` and ``test_policies_extra.py``)."""
MAX_NEW = {"gemma3": 48, "aya_vision": 48}
"""New tokens per reply: 48 where the replies must run past the 24-token window of Gemma 3's local layers (Aya
Vision's Cohere2 sliding-window layers), else 24 (``DEFAULT_NEW``)."""
DEFAULT_NEW = 24
PROMPTS_PER_KIND = {"gemma3": 2}
"""Prompts per input kind: two for Gemma 3 (its matrix before the others joined), else one (the main matrix,
``test_lossless.py``, varies the prompts; these families' own ways are in their inputs)."""
MEDIA = {
    "image": {"image": make_image(0)},
    "two_images": {"image": [make_image(1), make_image(2)]},
    "video": {"video": make_video_frames(3)},
    "text": {},
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tiny_root):
    """The family's pair pipeline and its cases: ``(label, call keywords, generate()'s reply)`` for every input kind
    it takes x its prompts."""
    pair = build_tiny_pair(request.param, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    cases, new = [], MAX_NEW.get(request.param, DEFAULT_NEW)
    for kind in input_kinds(request.param):
        for prompt in PROMPTS[: PROMPTS_PER_KIND.get(request.param, 1)]:
            call = {**MEDIA[kind], "prompt": prompt, "max_new_tokens": new}
            inputs = pipe.prepare_inputs(call.get("image"), prompt, video=call.get("video"))
            cases.append((f"{request.param}/{kind}/{prompt!r}", call, pipe.reference_generate(inputs, new)))
    return request.param, pipe, cases


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate(family_case, policy):
    _, pipe, cases = family_case
    check_replies_equal_generate(pipe, policy, cases)


def test_a_pruned_draft_keeps_the_replies(family_case):
    """The draft sees half of each picture's (or tile's, or frame's) tokens, its prefill built by vlmspec."""
    _, pipe, cases = family_case
    check_a_pruned_draft_keeps_the_replies(pipe, cases)


def test_an_edd_draft_keeps_the_replies(family_case):
    """An (untrained) EDD draft of the family's target, one layer drafting from the target's hidden states (an
    attention layer where the target has recurrent ones; refused for Gemma 4, ``test_gemma4.py``)."""
    family, pipe, cases = family_case
    if family == "gemma4":
        with pytest.raises(InvalidInputError, match="EDD draft cannot be built"):
            EDDDraft.for_target(pipe.target)
        return
    edd = VLMSpecPipeline(pipe.target, EDDDraft.for_target(pipe.target), pipe.processor, policy="ar")
    check_replies_equal_generate(edd, "sage", cases)


@pytest.mark.parametrize("policy", ["chain", "sage"])
def test_a_batch_equals_each_request_s_generate(family_case, policy):
    family, pipe, _ = family_case
    pipe.policy = get_policy(policy)
    without = ("video",) if family in IMAGE_ONLY_FAMILIES else ()
    check_batch_equals_generate(pipe, mixed_requests(without=without), f"{family}/{policy}")


def test_a_conversation_with_pictures_in_two_turns(family_case):
    """Later turns prefill on the caches of the earlier ones (their pictures included; Qwen3.5's recurrent states
    from the last prompt's end, where they were kept)."""
    check_a_conversation_with_pictures_equals_generate(family_case[1])
