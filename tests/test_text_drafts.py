"""A language model drafting for a VLM (``gemma-3-1b-it`` for Gemma 3, ``Qwen3-0.6B`` for Qwen3-VL, ...): the tiny
pairs' drafts' language models on their own (:func:`vlmspec.testing.build_tiny_text_draft`).

Lossless as any draft, and it reads what it should: the prompt's text without a single visual token, at consecutive
positions, which is what the same language model computes for the text-only prompt (checked on its logits, past
Gemma 3's 24-token window of local layers)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS
from conftest import input_kinds as media_kinds
from test_batching import check_batch_equals_generate, mixed_requests
from transformers import AutoModelForCausalLM, AutoTokenizer

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.loading import check_compatible
from vlmspec.models import TextDraftAdapter, adapter_for, base
from vlmspec.testing import FAMILIES, build_tiny_pair, build_tiny_text_draft, input_kinds, make_image

TEXT_DRAFT_FAMILIES = (
    *FAMILIES,
    "gemma3",
    "llava_next_video",
    "aya_vision",
    "ovis2",
)  # LLaVA-NeXT-Video: a LLaMA draft, pictures and video; Aya Vision: a Cohere2 draft with its sliding window; Ovis2: a
# Qwen2 draft with the picture's indicator tokens (text to it)
MAX_NEW = 32
MEDIA = {kind: (image, video) for kind, image, video in media_kinds()}


@functools.cache
def _text_pipe(family: str, root: Path) -> VLMSpecPipeline:
    """A family's tiny target with its draft's language model as the draft (built once per module run)."""
    pair = build_tiny_pair(family, root=root)
    draft = build_tiny_text_draft(family, root=root)
    return VLMSpecPipeline.from_pretrained(pair.target, draft, policy="sage", torch_dtype=torch.float32)


@pytest.fixture(scope="module", params=TEXT_DRAFT_FAMILIES)
def text_pipe(request, tiny_root):
    return request.param, _text_pipe(request.param, tiny_root)


def test_greedy_equals_generate_and_the_draft_reads_no_visual_token(text_pipe):
    family, pipe = text_pipe
    pipe.policy = get_policy("sage")
    accepted = 0.0
    for kind in input_kinds(family):
        image, video = MEDIA[kind]
        inputs = pipe.prepare_inputs(image, PROMPTS[0], video=video)
        out = pipe(image, PROMPTS[0], video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW), f"{family}/{kind}"
        assert out.stats.draft_visual_tokens == 0
        assert (out.stats.target_visual_tokens > 0) == (kind != "text")
        accepted += out.stats.mean_accepted
    assert accepted > 0


def test_the_draft_reads_the_text_only_prompt_at_consecutive_positions(text_pipe):
    """The draft's prefill and its decoding forwards give the logits its own language model gives the prompt with
    every visual token taken out, then the reply: nothing of the pictures, no gap where they were (40 reply tokens,
    so Gemma 3's local layers run past their 24-token window)."""
    family, pipe = text_pipe
    adapter = pipe.draft_adapter
    assert isinstance(adapter, TextDraftAdapter)
    image, video = MEDIA["video" if "video" in input_kinds(family) else "image"]
    inputs = pipe.prepare_inputs(image, PROMPTS[1], video=video)
    ids = inputs["input_ids"][0]
    visual = adapter.prompt_layout(inputs).visual
    reply = pipe.reference_generate(inputs, 40)
    text_only = torch.cat([ids[~visual], torch.tensor(reply)])[None]  # [1, T + 40]
    with torch.no_grad():
        expected = pipe.draft(input_ids=text_only).logits[0]  # [T + 40, V]
    prefill = adapter.prefill(inputs, keep=None)
    assert prefill.state.length == int((~visual).sum())
    torch.testing.assert_close(prefill.logits, expected[-41], rtol=1e-4, atol=1e-4)
    length = ids.numel()  # logical positions count the visual tokens too
    tokens = torch.tensor(reply[:-1])
    keys = prefill.state.length + tokens.numel()
    hidden = torch.finfo(torch.float32).min
    causal = torch.full((tokens.numel(), keys), hidden).triu(prefill.state.length + 1)[None, None]
    logits = adapter.forward(prefill.state, tokens, torch.arange(length, length + tokens.numel()), causal)
    torch.testing.assert_close(logits, expected[-40:-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_a_batch_and_a_conversation_equal_generate(family, tiny_root):
    """On two families (Qwen3-VL's M-RoPE target, Gemma 3's local layers): the batched prefill and the turn cache
    run the adapter's prefill and positions, which the tests above check for every family."""
    pipe = _text_pipe(family, tiny_root)
    pipe.policy = get_policy("chain")
    check_batch_equals_generate(pipe, mixed_requests(), family)
    chat = pipe.chat(max_new_tokens=24)
    for turn, image in (("Describe this image.", make_image(1)), ("And what else?", None)):
        out = chat.send(turn, images=image)
        assert out.token_ids == pipe.reference_generate(pipe.prepare_messages(chat.messages[:-1]), 24)
        assert out.stats.draft_visual_tokens == 0


def test_a_prune_ratio_changes_nothing_and_runs_no_scoring_pass(text_pipe, tiny_root, monkeypatch):
    """The draft leaves every visual token out whatever the ratio, so the target's attention over them, which
    attention-guided pruning reads, is never measured."""
    family, pipe = text_pipe
    pipe.policy = get_policy("chain")
    scored = []
    monkeypatch.setattr(base, "visual_scores", lambda *args: scored.append(args))
    image = make_image(3)
    expected = pipe.reference_generate(pipe.prepare_inputs(image, PROMPTS[2]), MAX_NEW)
    for ratio in (None, 0.5):
        out = pipe(image, PROMPTS[2], max_new_tokens=MAX_NEW, prune_ratio=ratio)
        assert out.token_ids == expected and out.stats.draft_visual_tokens == 0
    assert not scored
    pair = build_tiny_pair(family, root=tiny_root)  # with the family's VLM draft, the same call measures it
    with_pictures = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", torch_dtype=torch.float32
    )
    with_pictures(image, PROMPTS[2], max_new_tokens=4, prune_ratio=0.5)
    assert scored


def test_a_language_model_is_refused_as_a_target_and_without_one(tiny_root):
    pair = build_tiny_pair("qwen3_vl", root=tiny_root)
    text = build_tiny_text_draft("qwen3_vl", root=tiny_root)
    with pytest.raises(
        InvalidInputError, match=r"'qwen3' is a language model.*draft of a VLM target, not the target"
    ):
        VLMSpecPipeline.from_pretrained(text, pair.draft)
    with pytest.raises(InvalidInputError, match=r"reads no pictures: it can only draft for a VLM target"):
        adapter_for(AutoModelForCausalLM.from_pretrained(text))


def test_a_language_model_without_the_vlm_s_added_tokens_drafts_for_it(tiny_root):
    """SmolLM2 under SmolVLM (49152 rows, 49280 tokens), Vicuna under LLaVA-1.5 (32000, 32002): the VLM's tokenizer
    added special tokens past the language model's table, here SmolVLM2's tile markup, ``<end_of_utterance>`` and the
    chat tokens after them. The draft is fed a stand-in for each and never proposes one: replies to pictures, a video
    and text are ``generate()``'s. A table that misses an ordinary token is still refused."""
    pair = build_tiny_pair("smolvlm", root=tiny_root)
    draft = build_tiny_text_draft("smolvlm", root=tiny_root, base_vocabulary=True)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, draft, policy="sage", torch_dtype=torch.float32)
    rows = pipe.draft.get_input_embeddings().weight.shape[0]
    added = [i for i in pipe.tokenizer.added_tokens_decoder if i >= rows]
    assert len(pipe.tokenizer) - rows == len(added) == 10
    im_start = pipe.tokenizer.convert_tokens_to_ids("<|im_start|>")
    accepted = 0.0
    for kind in input_kinds("smolvlm"):
        image, video = MEDIA[kind]
        inputs = pipe.prepare_inputs(image, PROMPTS[1], video=video)
        assert (
            im_start in inputs["input_ids"][0].tolist() and im_start >= rows
        )  # fed to the draft as a stand-in
        out = pipe(image, PROMPTS[1], video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW), kind
        accepted += out.stats.mean_accepted
    assert accepted > 0
    short = AutoModelForCausalLM.from_pretrained(draft)
    short.resize_token_embeddings(rows - 20)  # ordinary tokens cut off too
    with pytest.raises(InvalidInputError, match=r"draft's vocabulary has \d+ entries"):
        check_compatible(pipe.target, short, pipe.tokenizer, AutoTokenizer.from_pretrained(draft))


def test_a_language_model_of_another_tokenizer_is_refused(tiny_root):
    """Qwen3-VL's target with Qwen2-VL's fixture tokenizer under its draft: the vocabularies differ."""
    pair = build_tiny_pair("qwen3_vl", root=tiny_root)
    other = build_tiny_text_draft("gemma3", root=tiny_root)
    with pytest.raises(InvalidInputError, match=r"draft's (tokenizer differs|vocabulary has)"):
        VLMSpecPipeline.from_pretrained(pair.target, other)


def test_the_bench_s_assisted_generation_row_says_why_it_cannot_run(tiny_root):
    """transformers' assisted generation hands its assistant the target's processor outputs, pixels included: the
    bench's ``hf_assisted`` row names that instead of transformers' unused-kwargs error."""
    from vlmspec_eval import methods

    pipe = _text_pipe("qwen2_vl", tiny_root)
    inputs = pipe.prepare_inputs(make_image(0), PROMPTS[0])
    with pytest.raises(TypeError, match="a language-model draft does not take"):
        methods.assisted_generate(pipe, inputs, 4)


def test_a_saved_pipeline_loads_back_with_its_language_model_draft(tiny_root, tmp_path):
    pipe = _text_pipe("qwen3_vl", tiny_root)
    pipe.save_pretrained(tmp_path / "saved")
    back = VLMSpecPipeline.from_pretrained(tmp_path / "saved", torch_dtype=torch.float32)
    assert isinstance(back.draft_adapter, TextDraftAdapter)
    image = make_image(4)
    out = back(image, PROMPTS[3], max_new_tokens=MAX_NEW)
    assert out.token_ids == pipe.reference_generate(pipe.prepare_inputs(image, PROMPTS[3]), MAX_NEW)
    assert out.stats.mean_accepted > 0
