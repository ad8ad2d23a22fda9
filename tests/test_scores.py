"""``output_scores``/``output_logits`` and ``generation_config``: what ``generate()`` returns and takes besides the ids,
read off the verification forwards (:mod:`vlmspec.scores`)."""

from __future__ import annotations

import copy

import pytest
import torch
from batches import image_and_text_prompts
from transformers import GenerationConfig

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.scores import greedy_logits
from vlmspec.testbed import sample
from vlmspec.testing import build_tiny_pair, make_image

SCORED = {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}


@pytest.fixture(scope="module")
def mini():
    return VLMSpecPipeline.from_pretrained("testbed-mini", policy="sage")


@pytest.fixture(scope="module")
def tiny(tiny_root):
    pair = build_tiny_pair("qwen2_vl", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="static", torch_dtype=torch.float32
    )


@pytest.fixture
def config_of(tiny):
    saved = copy.deepcopy(tiny.target.generation_config)
    yield tiny.target.generation_config
    tiny.target.generation_config = saved


def assert_steps_match(ours: tuple, theirs: tuple) -> None:
    """Same number of ``[B, V]`` steps, the same ``-inf`` entries, the finite ones equal up to float noise."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        finite = torch.isfinite(b)
        torch.testing.assert_close(a[finite], b[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["sage", "chain", "ar"])
def test_greedy_scores_and_logits_are_generate_s(mini, policy):
    """Every node the target verifies gives the logits a plain step would: the raw logits, and the scores after
    the repetition penalty, for every new token, with the same ids."""
    mini.policy = get_policy(policy)
    example = sample("image_caption", 1)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    options = {"max_new_tokens": 24, "repetition_penalty": 1.2, **SCORED}
    theirs = mini.target.generate(**inputs, do_sample=False, **options)
    ours = mini.generate(**inputs, **options)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_steps_match(ours.logits, theirs.logits)
    assert_steps_match(ours.scores, theirs.scores)
    assert not torch.equal(ours.scores[3], ours.logits[3])  # the penalty changed them: two different fields
    ours_steps = mini.target.compute_transition_scores(ours.sequences, ours.scores, normalize_logits=True)
    theirs_steps = mini.target.compute_transition_scores(
        theirs.sequences, theirs.scores, normalize_logits=True
    )
    torch.testing.assert_close(ours_steps, theirs_steps, atol=1e-4, rtol=1e-4)  # per-token log-probabilities
    if policy != "ar":
        assert mini(example.image, example.prompt, max_new_tokens=24).stats.mean_accepted > 1


def test_only_the_fields_asked_for_are_returned(mini):
    example = sample("image_caption", 2)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    out = mini.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
    assert out.scores is None and len(out.logits) == 4
    assert torch.is_tensor(mini.generate(**inputs, max_new_tokens=4, output_scores=True))  # no dict: ids only


def test_a_row_that_ends_early_has_certain_padding_after_its_end(tiny, config_of):
    """A batch's rows each get their own prompt's scores; after a row's EOS its steps hold -inf with 0 at the
    pad token (generate() computes and discards a finished row's scores there)."""
    image, prompt = make_image(0), "Describe this image."
    texts = image_and_text_prompts(tiny.processor, prompt)
    alone = [
        tiny.processor(text=texts[:1], images=[[image]], return_tensors="pt"),
        tiny.processor(text=texts[1:], return_tensors="pt"),
    ]
    plain = [tiny.target.generate(**a, do_sample=False, max_new_tokens=10, **SCORED) for a in alone]
    new = [p.sequences[0, a["input_ids"].shape[1] :].tolist() for p, a in zip(plain, alone, strict=True)]
    eos = next(t for t in new[0][1:6] if t not in new[1])  # ends row 0 early, never row 1
    config_of.pad_token_id = pad = next(t for t in range(3, 50) if t != eos)
    stop = new[0].index(eos) + 1
    batch = tiny.processor(text=texts, images=[[image], []], padding=True, return_tensors="pt")
    out = tiny.generate(**batch, max_new_tokens=10, eos_token_id=eos, **SCORED)
    assert len(out.scores) == 10 and out.scores[0].shape[0] == 2
    for t in range(10):
        torch.testing.assert_close(out.logits[t][1], plain[1].logits[t][0], atol=1e-4, rtol=1e-4)
        if t < stop:
            torch.testing.assert_close(out.logits[t][0], plain[0].logits[t][0], atol=1e-4, rtol=1e-4)
        else:
            certain = torch.full_like(out.scores[t][0], float("-inf"))
            certain[pad] = 0.0
            assert torch.equal(out.scores[t][0], certain) and torch.equal(out.logits[t][0], certain)


def test_sampled_scores_are_the_warped_distribution_the_token_was_drawn_from(mini):
    """Sampling: ``scores`` are the logits after generate()'s warpers (temperature, top-k), so each drawn token
    is among the ``top_k`` finite entries of its step."""
    mini.policy = get_policy("sage")
    example = sample("image_caption", 3)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    length = inputs["input_ids"].shape[1]
    out = mini.generate(
        **inputs,
        max_new_tokens=16,
        do_sample=True,
        temperature=0.7,
        top_k=5,
        seed=3,
        eos_token_id=[],
        **SCORED,
    )
    for t, token in enumerate(out.sequences[0, length:].tolist()):
        logits, scores = out.logits[t][0], out.scores[t][0]
        kept = torch.isfinite(scores)
        assert int(kept.sum()) == 5 and bool(kept[token])
        assert torch.equal(kept, torch.zeros_like(kept).index_fill(0, logits.topk(5).indices, True))
        torch.testing.assert_close(scores[kept], logits[kept] / 0.7)


def test_pipe_call_returns_the_scores_of_its_tokens(mini):
    """``pipe(..., output_scores=True)``: ``[T, V]`` logits and scores; greedy tokens are their argmax."""
    mini.policy = get_policy("sage")
    example = sample("video_caption", 1)
    out = mini(example.image, example.prompt, example.video, max_new_tokens=20, output_scores=True)
    assert out.scores.scores.shape == (len(out.token_ids), mini.target.config.get_text_config().vocab_size)
    assert out.scores.scores.argmax(-1).tolist() == out.token_ids
    assert mini(example.image, example.prompt, example.video, max_new_tokens=2).scores is None
    with pytest.raises(TypeError, match=r"output_scores='yes' is invalid: use True"):
        mini(example.image, example.prompt, output_scores="yes")


def test_a_generation_config_is_merged_over_the_target_s_as_generate_merges_it(tiny, config_of):
    """``generation_config=``: its settings over the target's (the target's EOS still applies where it sets none);
    a call's off value overrides a setting vlmspec does not apply (``num_beams=1`` over the config's 4)."""
    inputs = tiny.prepare_inputs(make_image(1), "Describe this image.")
    length = inputs["input_ids"].shape[1]
    free = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=12)[0, length:].tolist()
    config_of.eos_token_id = free[4]
    for given in (GenerationConfig(max_new_tokens=12), GenerationConfig(max_new_tokens=3)):
        expected = tiny.target.generate(**inputs, generation_config=given)[0, length:].tolist()
        assert expected == free[: min(5, given.max_new_tokens)]  # the target's EOS and the given length
        assert tiny.generate(**inputs, generation_config=given)[0, length:].tolist() == expected
    config_of.eos_token_id = None
    given = GenerationConfig(max_new_tokens=12, repetition_penalty=0.5)
    expected = tiny.target.generate(**inputs, generation_config=given)[0, length:].tolist()
    assert (
        expected != free and tiny.generate(**inputs, generation_config=given)[0, length:].tolist() == expected
    )
    with pytest.raises(
        TypeError, match=r"generation_config=\{'max_new_tokens': 3\} is invalid: use a transformers"
    ):
        tiny.generate(**inputs, generation_config={"max_new_tokens": 3})

    config_of.num_beams = 4
    with pytest.raises(InvalidInputError, match=r"generation_config sets num_beams=4"):
        tiny.generate(**inputs, max_new_tokens=5)
    plain = tiny.target.generate(**inputs, num_beams=1, max_new_tokens=5)
    assert torch.equal(tiny.generate(**inputs, num_beams=1, max_new_tokens=5), plain)
    with pytest.raises(
        InvalidInputError, match=r"output_attentions: vlmspec returns sequences, scores and logits"
    ):
        tiny.generate(**inputs, num_beams=1, return_dict_in_generate=True, output_attentions=True)


def test_num_return_sequences_draws_that_many_samples_per_prompt(mini):
    """Each prompt's sequences next to each other, as generate() orders them, each drawn with its own seed (row
    ``i`` of the expanded batch with ``seed + i``); greedy decoding has one answer and is refused, as generate()
    refuses it. The same draw at batch 3 and alone needs the same trees: the policy's hardware options are pinned to
    one fit (left free, each batch size refits them from the cost probe, whose reading a busy machine changes)."""
    mini.policy = get_policy("sage")
    fitted = mini.policy.config
    mini.policy = get_policy("sage", **{f: getattr(fitted, f) for f in mini.policy.free_hardware_options()})
    assert not mini.policy.free_hardware_options()
    example = sample("image_caption", 4)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    options = {"max_new_tokens": 12, "do_sample": True, "temperature": 1.5}
    out = mini.generate(**inputs, num_return_sequences=3, seed=7, **options)
    assert out.shape[0] == 3 == mini.target.generate(**inputs, num_return_sequences=3, **options).shape[0]
    for i in range(3):
        alone = mini.generate(**inputs, seed=7 + i, **options)
        assert out[i, : alone.shape[1]].tolist() == alone[0].tolist()
    assert len({tuple(row.tolist()) for row in out}) > 1
    with pytest.raises(InvalidInputError, match=r"num_return_sequences=2 without sampling: greedy decoding"):
        mini.generate(**inputs, num_return_sequences=2, max_new_tokens=4)


def test_renormalized_scores_are_log_probabilities_as_generate_s(mini):
    """A config's renormalize_logits log-softmaxes the scores last (after the warpers), as generate() does."""
    example = sample("image_caption", 5)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    options = {"max_new_tokens": 8, "renormalize_logits": True, **SCORED}
    for extra in (
        {},
        {"do_sample": True, "top_k": 4, "temperature": 0.8, "seed": 2, "no_repeat_ngram_size": 2},
    ):
        ours = mini.generate(**inputs, **options, **extra)
        steps = torch.cat(ours.scores)
        assert torch.allclose(steps.logsumexp(-1), torch.zeros(len(ours.scores)), atol=1e-5)
        if not extra:
            theirs = mini.target.generate(**inputs, do_sample=False, **options)
            assert_steps_match(ours.scores, theirs.scores)


def test_a_pad_token_beyond_the_logits_leaves_finished_rows_all_minus_infinity(tiny, config_of):
    inputs = tiny.prepare_inputs(make_image(2), "Describe this image.")
    length = inputs["input_ids"].shape[1]
    vocab = tiny.target.get_output_embeddings().weight.shape[0]
    out = tiny.generate(**inputs, max_new_tokens=5, pad_token_id=vocab + 5, **SCORED)
    expected = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=5)[0, length:].tolist()
    assert out.sequences[0, length:].tolist() == expected and len(out.scores) == len(expected)
    with pytest.raises(TypeError, match=r"pipe.stream\(\) yields text pieces, not scores"):
        tiny.stream(make_image(2), "Hi", output_scores=True)


@pytest.mark.parametrize("task", ["image_caption", "video_caption"])
def test_token_logprobs_are_generate_s_logits_in_one_forward(mini, task):
    """Teacher forcing on the target's own greedy reply: each row is the log-softmax of the logits ``generate()``
    computed for that token (a clip's prompt too: its per-token ``mm_token_type_ids`` grow with the text)."""
    example = sample(task, 7)
    inputs = mini.prepare_inputs(example.image, example.prompt, video=example.video)
    out = mini.target.generate(**inputs, max_new_tokens=20, do_sample=False, **SCORED)
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = mini.token_logprobs(inputs, tokens)  # [n, V]
    assert logprobs.shape == (len(tokens), out.logits[0].shape[-1]) and logprobs.dtype == torch.float32
    expected = torch.cat(out.logits).float().log_softmax(-1)
    torch.testing.assert_close(logprobs, expected, atol=1e-4, rtol=1e-4)
    assert logprobs.argmax(-1).tolist() == tokens  # greedy: every token is its row's most likely
    assert torch.equal(mini.token_logprobs(inputs, torch.tensor(tokens)), logprobs)  # a 1-D tensor too
    other = mini.token_logprobs(inputs, [tokens[0]] + [tokens[2]] * (len(tokens) - 1))
    torch.testing.assert_close(other[0], logprobs[0])  # the prompt alone decides the first row
    assert not torch.allclose(other[2:], logprobs[2:])


def test_greedy_logits_are_generate_s_new_ids_and_raw_logits(mini):
    """``greedy_logits``: the new ids of the model's own greedy ``generate()`` and the float32 ``[B, T, V]`` logits
    it chose them from (``output_logits``), every token its row's argmax."""
    example = sample("image_caption", 3)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    new, logits = greedy_logits(mini.target, inputs, 12)
    out = mini.target.generate(**inputs, max_new_tokens=12, do_sample=False, **SCORED)
    assert torch.equal(new, out.sequences[:, inputs["input_ids"].shape[1] :])
    assert logits.dtype == torch.float32 and torch.equal(logits, torch.stack(out.logits, dim=1).float())
    assert torch.equal(logits.argmax(-1), new)


def test_token_logprobs_refuse_what_is_not_a_continuation(mini):
    example = sample("image_caption", 1)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    with pytest.raises(InvalidInputError, match="token_ids is empty"):
        mini.token_logprobs(inputs, [])
    with pytest.raises(InvalidInputError, match=r"token_ids has shape \(1, 2\); give one continuation's ids"):
        mini.token_logprobs(inputs, torch.tensor([[1, 2]]))
    vocab = mini.target.config.get_text_config().vocab_size
    with pytest.raises(InvalidInputError, match="token_ids"):
        mini.token_logprobs(inputs, [1, vocab])
    with pytest.raises(InvalidInputError, match="one prompt"):
        mini.token_logprobs({**inputs, "input_ids": inputs["input_ids"].repeat(2, 1)}, [1])
