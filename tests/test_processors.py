"""generate()'s sequence-dependent logits processors (repetition penalty, minimum length, suppressed tokens) keep
speculative output the target's own: per tree node against transformers' processors, and end to end."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from batches import image_and_text_prompts
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from vlmspec import InputTypeError, InvalidInputError, VLMSpecPipeline, get_policy, hf_compat
from vlmspec.processors import LogitsProcessing, OccurrencePenalties
from vlmspec.testbed import sample
from vlmspec.testing import build_tiny_pair, make_image
from vlmspec.tree import TokenTree

POLICIES = ("ar", "chain", "sage", "static")


def test_every_tree_node_gets_generate_s_processing_of_the_sequence_it_ends():
    """Each node's row equals transformers' processors run on prompt + generated tokens + the node's path."""
    torch.manual_seed(0)
    vocab, prompt, generated = 40, torch.randint(0, 40, (12,)), [7, 3]
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2])
    tree = TokenTree(tokens=torch.tensor([3, 5, 9, 5, 30, 12, 7]), parents=parents, draft_probs=torch.ones(7))
    logits = torch.randn(7, vocab) * 3
    processing = LogitsProcessing(
        repetition_penalty=1.7, min_new_tokens=4, suppress_tokens=(2, 11), eos_token_ids=(30, 12)
    )
    processed = processing.start(prompt, vocab)
    processed.commit(torch.tensor(generated))  # the root (3) is the last generated token
    out = processed.tree(logits, tree, len(generated))

    hf = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.7),
        MinNewTokensLengthLogitsProcessor(prompt.shape[0], 4, torch.tensor([30, 12])),
        SuppressTokensLogitsProcessor([2, 11]),
    ])  # fmt: skip
    for node in range(7):
        path = tree.tokens[tree.ancestors[node]][1:].tolist()  # below the root, root first
        sequence = torch.tensor([[*prompt.tolist(), *generated, *path]])
        assert torch.equal(out[node], hf(sequence, logits[node : node + 1].clone())[0]), f"node {node}"
    assert out[1, 30] == float("-inf") and out[3, 30] > float("-inf")  # depth 1: 3 new tokens < 4; depth 2: 4


class _OpenAIPenalties(LogitsProcessor):
    """The reference: OpenAI's presence and frequency penalties and logit bias as a transformers processor (the new
    tokens after ``prompt_len`` counted), run by ``generate()`` after its own list."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]) -> None:
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, new, torch.ones_like(new, dtype=scores.dtype))
        scores = scores - self.frequency * counts - self.presence * (counts > 0).float()
        bias = torch.zeros(scores.shape[-1])
        for token, value in self.bias.items():
            bias[token] = value
        return scores + bias


def test_occurrence_penalties_give_every_node_the_counts_of_its_own_new_tokens():
    """Each node's row: the repetition penalty over the whole sequence, then presence/frequency over the new tokens
    only (the prompt's 5 and 9 do not count) and the bias; the root, the last token emitted, counted once."""
    torch.manual_seed(1)
    vocab, prompt, generated = 40, torch.tensor([5, 9, 9, 21, 5]), [7, 3, 7]
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2])
    tree = TokenTree(tokens=torch.tensor([7, 5, 9, 7, 30, 7, 3]), parents=parents, draft_probs=torch.ones(7))
    logits = torch.randn(7, vocab) * 3
    occurrence = OccurrencePenalties.for_call(0.7, 0.45, {9: 2.5, 30: -1.0}, vocab)
    processed = LogitsProcessing(repetition_penalty=1.3, occurrence=occurrence).start(prompt, vocab)
    processed.commit(torch.tensor(generated))
    out = processed.tree(logits, tree, len(generated))
    hf = LogitsProcessorList(
        [RepetitionPenaltyLogitsProcessor(1.3), _OpenAIPenalties(5, 0.7, 0.45, {9: 2.5, 30: -1.0})]
    )
    for node in range(7):
        path = tree.tokens[tree.ancestors[node]][1:].tolist()
        sequence = torch.tensor([[*prompt.tolist(), *generated, *path]])
        assert torch.equal(out[node], hf(sequence, logits[node : node + 1].clone())[0]), f"node {node}"
    first = LogitsProcessing(occurrence=occurrence).start(prompt, vocab).first(logits[0])
    assert torch.equal(first, logits[0] + hf[1](prompt[None], torch.zeros(1, vocab))[0])  # the bias alone


@pytest.mark.parametrize(
    ("presence", "frequency", "bias", "error", "words"),
    [(float("nan"), 0, None, InvalidInputError, "presence_penalty=nan"),
     (0, "1", None, InputTypeError, "frequency_penalty='1'"),
     (0, 0, {40: 1.0}, InvalidInputError, "the key 40: use token ids, integers from 0 to 39"),
     (0, 0, [1], InputTypeError, "a dict"), (0, 0, {3: float("inf")}, InvalidInputError, "logit_bias[3]=inf")],
)  # fmt: skip
def test_bad_occurrence_penalties_are_refused_naming_them(presence, frequency, bias, error, words):
    with pytest.raises(error, match=re.escape(words)):
        OccurrencePenalties.for_call(presence, frequency, bias, 40)


def test_occurrence_penalties_that_change_nothing_are_none_and_any_mapping_is_a_bias():
    from types import MappingProxyType

    assert OccurrencePenalties.for_call(0, 0.0, {5: 0}, 40) is None
    assert OccurrencePenalties.for_call(0, 0, MappingProxyType({5: 1}), 40).bias == ((5, 1.0),)


@pytest.fixture(scope="module")
def mini():
    return VLMSpecPipeline.from_pretrained("testbed-mini", policy="ar")


def test_a_checkpoint_s_repetition_penalty_keeps_every_policy_identical_to_generate(mini):
    """Qwen2-VL/Qwen2.5-VL Instruct ship repetition_penalty=1.05: generate() applies it, so vlmspec must too."""
    config = mini.target.generation_config
    for task in ("image_caption", "video_caption"):
        example = sample(task, 1)
        inputs = mini.prepare_inputs(example.image, example.prompt, example.video)
        length = inputs["input_ids"].shape[1]
        plain = mini.target.generate(**inputs, do_sample=False, max_new_tokens=64)[0, length:].tolist()
        config.repetition_penalty = 1.05
        try:
            expected = mini.target.generate(**inputs, do_sample=False, max_new_tokens=64)[0, length:].tolist()
            assert expected != plain  # the penalty changes these captions
            for policy in POLICIES:
                mini.policy = get_policy(policy)
                out = mini(example.image, example.prompt, video=example.video, max_new_tokens=64)
                assert out.token_ids == expected, f"{task}/{policy}"
        finally:
            config.repetition_penalty = 1.0


@pytest.fixture(scope="module")
def tiny(tiny_root):
    pair = build_tiny_pair("qwen2_vl", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)


def test_penalty_and_minimum_length_as_call_arguments_equal_generate_s(tiny):
    """A penalty below 1 (repeats favoured: it changes a random model's output) and an EOS that min_new_tokens
    keeps from ending the reply, greedy, sampled with top_k=1, through pipe(), pipe.generate() and pipe.batch()."""
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    plain = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=24)[0, length:].tolist()
    options = {"repetition_penalty": 0.5, "min_new_tokens": 6, "eos_token_id": plain[2], "max_new_tokens": 24}
    expected = tiny.target.generate(**inputs, do_sample=False, **options)[0, length:].tolist()
    assert expected[:6] != plain[:6] and len(expected) > 3
    sampled = tiny.target.generate(**inputs, do_sample=True, top_k=1, **options)[0, length:].tolist()
    for policy in POLICIES:
        tiny.policy = get_policy(policy)
        assert tiny(image, prompt, **options).token_ids == expected, policy
        assert tiny(image, prompt, do_sample=True, top_k=1, seed=0, **options).token_ids == sampled, policy
        assert tiny.generate(**inputs, **options)[0, length:].tolist() == expected, policy
    rows = tiny.batch(
        [{"image": image, "prompt": prompt, **options}] * 2
        + [{"image": image, "prompt": prompt, "max_new_tokens": 24}]
    )
    assert [row.token_ids for row in rows] == [expected, expected, plain]


def test_occurrence_penalties_keep_every_policy_and_a_batch_the_target_s_own(mini):
    """OpenAI's penalties and bias as pipe() arguments: each policy's reply, greedy and sampled with top_k=1, and
    a batch's rows, equal generate() with the reference processor."""
    example = sample("image_caption", 4)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    length = inputs["input_ids"].shape[1]
    plain = mini.target.generate(**inputs, do_sample=False, max_new_tokens=48)[0, length:].tolist()
    options = {"presence_penalty": 0.9, "frequency_penalty": 0.6, "logit_bias": {plain[4]: -4.0, 13: 1.0}}
    reference = LogitsProcessorList([_OpenAIPenalties(length, 0.9, 0.6, options["logit_bias"])])
    expected = mini.target.generate(**inputs, do_sample=False, max_new_tokens=48, logits_processor=reference)
    expected = expected[0, length:].tolist()
    assert expected != plain  # they change this caption
    stop = mini.tokenizer.decode(expected[20:23])  # a stop string inside the reply: it ends there
    cut = mini.target.generate(**inputs, do_sample=False, max_new_tokens=48, logits_processor=reference,
                               stop_strings=stop, tokenizer=mini.tokenizer)[0, length:].tolist()  # fmt: skip
    assert len(cut) < len(expected)
    for policy in (*POLICIES, "eagle2"):
        mini.policy = get_policy(policy)
        assert mini(example.image, example.prompt, max_new_tokens=48, **options).token_ids == expected, policy
        sampled = mini(
            example.image, example.prompt, max_new_tokens=48, do_sample=True, top_k=1, seed=1, **options
        )
        assert sampled.token_ids == expected, policy
        stopped = mini(example.image, example.prompt, max_new_tokens=48, stop_strings=stop, **options)
        assert stopped.token_ids == cut, policy
    request = {"image": example.image, "prompt": example.prompt, "max_new_tokens": 48}
    rows = mini.batch([dict(request, **options), request, dict(request, **options)], batch_size=3)
    assert [row.token_ids for row in rows] == [expected, plain, expected]
    mini.policy = get_policy("ar")


def test_occurrence_penalties_with_generate_s_other_processors_are_refused(tiny, config_of):
    """Those run transformers' list over the tree, which has no OpenAI penalties: refused, saying what to do."""
    config_of.no_repeat_ngram_size = 2
    with pytest.raises(
        InvalidInputError,
        match=r"cannot be combined with the generate\(\) logits processors.*turn those off.*logits_processor",
    ):
        tiny(make_image(0), "Describe.", presence_penalty=0.5, max_new_tokens=4)


def test_generate_settings_vlmspec_does_not_apply_are_refused_by_name(tiny):
    config = tiny.target.generation_config
    config.guidance_scale = 3.0
    try:
        with pytest.raises(InvalidInputError, match=r"generation_config sets guidance_scale=3.0.*= None"):
            tiny(make_image(0), "Hi", max_new_tokens=2)
    finally:
        config.guidance_scale = None
    with pytest.raises(InvalidInputError, match="repetition_penalty=0 is invalid: use a number > 0"):
        tiny(make_image(0), "Hi", repetition_penalty=0)
    with pytest.raises(InvalidInputError, match="min_new_tokens=-1 is invalid"):
        tiny(make_image(0), "Hi", min_new_tokens=-1)


def test_every_sampling_warper_of_the_generation_config_is_generate_s():
    """temperature, top-k, top-p, min-p, typical-p, epsilon and eta from a generation_config give the distribution
    transformers' own warpers give."""
    from transformers import GenerationConfig, GenerationMixin

    from vlmspec.sampling import SamplingParams

    config = GenerationConfig(
        do_sample=True, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, typical_p=0.97, epsilon_cutoff=3e-4,
        eta_cutoff=1e-3,
    )  # fmt: skip
    owner = type("Model", (GenerationMixin,), {"config": type("C", (), {"is_encoder_decoder": False})()})()
    hf = owner._get_logits_processor(config, input_ids_seq_length=4, device="cpu")
    assert len(hf) == 7
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    expected = torch.softmax(hf(torch.zeros(5, 4, dtype=torch.long), logits.clone()), dim=-1)
    assert torch.allclose(SamplingParams.resolve(config).probs(logits), expected)


def test_sampling_applies_the_configs_min_p(tiny):
    """min_p=1 keeps only the most likely token: sampled output is then the greedy one, as in generate()."""
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    greedy = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=16)[0, length:].tolist()
    config = tiny.target.generation_config
    config.min_p = 1.0
    try:
        tiny.policy = get_policy("chain")
        assert tiny(image, prompt, do_sample=True, top_k=0, seed=3, max_new_tokens=16).token_ids == greedy
    finally:
        config.min_p = None


def test_min_new_tokens_takes_precedence_over_the_config_s_min_length_and_odd_ids_are_ignored(tiny):
    """generate() turns a given min_new_tokens into min_length = prompt + min_new_tokens, so a call's smaller one
    lowers the config's; EOS and begin-suppress ids beyond the vocabulary are ignored, as transformers does."""
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    plain = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=16)[0, length:].tolist()
    vocab = tiny.target.get_input_embeddings().weight.shape[0]
    config = tiny.target.generation_config
    config.min_length, config.begin_suppress_tokens = length + 12, [vocab + 3]
    tiny.policy = get_policy("chain")
    try:
        for options in ({"min_new_tokens": 2}, {"min_new_tokens": 0}, {}):
            call = {"eos_token_id": plain[3], "max_new_tokens": 16, **options}
            expected = tiny.target.generate(**inputs, do_sample=False, **call)[0, length:].tolist()
            assert tiny(image, prompt, **call).token_ids == expected, options
        assert len(tiny(image, prompt, eos_token_id=plain[3], min_new_tokens=2).token_ids) == 4
    finally:
        config.min_length, config.begin_suppress_tokens = 0, None


@pytest.fixture
def config_of(tiny):
    """The tiny target's generation_config, restored after the test."""
    saved = copy.deepcopy(tiny.target.generation_config)
    yield tiny.target.generation_config
    tiny.target.generation_config = saved


@pytest.mark.parametrize(
    "setting",
    [
        {"num_beams": 3},
        {"guidance_scale": 2.0},
        {"penalty_alpha": 0.6},
        {"token_healing": True},
        {"dola_layers": "high"},
    ],
)
def test_a_config_that_makes_generate_decode_otherwise_is_refused(tiny, config_of, setting):
    """Beam search, several sequences, classifier-free guidance, contrastive search, DoLa, token healing: a
    generation_config turning one on is refused, not decoded greedily."""
    (name, value), image = next(iter(setting.items())), make_image(0)
    setattr(config_of, name, value)
    inputs = tiny.prepare_inputs(image, "Hi")
    for call in (
        lambda: tiny(image, "Hi", max_new_tokens=2),
        lambda: tiny.generate(**inputs, max_new_tokens=2),
    ):
        with pytest.raises(InvalidInputError, match=rf"generation_config sets {name}={value!r}"):
            call()


def test_the_config_s_stop_strings_end_generation_as_in_generate(tiny, config_of):
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    tokenizer = tiny.processor.tokenizer
    plain = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=16)[0, length:].tolist()
    config_of.stop_strings = [tokenizer.decode(plain[3:5])]
    expected = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=16, tokenizer=tokenizer)
    expected = expected[0, length:].tolist()
    assert len(expected) < len(plain)
    tiny.policy = get_policy("chain")
    assert tiny(image, prompt, max_new_tokens=16).token_ids == expected
    assert tiny.generate(**inputs, max_new_tokens=16)[0, length:].tolist() == expected


def test_generate_resolves_options_over_the_config_as_generate_does(tiny, config_of):
    """An option passed as None turns the config's setting off; the length falls back to the config's max_length,
    then to 20 new tokens; return_dict_in_generate gives .sequences; finished rows pad with the call's EOS."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    tiny.policy = get_policy("chain")

    def both(**options):
        ours = tiny.generate(**inputs, **options)[0, length:].tolist()
        theirs = tiny.target.generate(**inputs, do_sample=False, **options)[0, length:].tolist()
        return ours, theirs

    plain = both(max_new_tokens=16)[1]
    config_of.repetition_penalty, config_of.eos_token_id = 0.5, plain[2]
    ours, theirs = both(max_new_tokens=16, repetition_penalty=None, eos_token_id=None)
    assert ours == theirs == plain  # neither the config's penalty nor its EOS
    config_of.repetition_penalty, config_of.eos_token_id = 1.0, None
    config_of.max_new_tokens, config_of.max_length = None, length + 7
    ours, theirs = both()
    assert ours == theirs and len(ours) == 7
    config_of.max_length = None
    ours, theirs = both()
    assert ours == theirs and len(ours) == 20
    out = tiny.generate(**inputs, max_new_tokens=4, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, tiny.generate(**inputs, max_new_tokens=4))
    config_of.pad_token_id = None
    assert hf_compat.pad_token_id(tiny.target, [plain[1], 5]) == plain[1]


def test_a_sampling_setting_passed_as_none_is_off_as_in_generate(tiny, config_of):
    """The config samples with top_k=1 (greedy in effect); top_k=None in the call turns top-k off, so seeds draw
    different replies, as generate(top_k=None) does."""
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    config_of.do_sample, config_of.top_k = True, 1
    assert hf_compat.resolve_options({"top_k": None}, config_of, 10)["top_k"] == 0
    tiny.policy = get_policy("chain")
    kept = {tuple(tiny.generate(**inputs, seed=s, max_new_tokens=8)[0].tolist()) for s in range(4)}
    off = {tuple(tiny.generate(**inputs, seed=s, max_new_tokens=8, top_k=None)[0].tolist()) for s in range(4)}
    assert len(kept) == 1 and len(off) > 1
    config_of.typical_p = 1.5
    with pytest.raises(
        InvalidInputError, match=r"typical_p=1.5 is invalid.*the target's generation_config sets it"
    ):
        tiny(image, prompt, do_sample=True, max_new_tokens=2)


def test_no_eos_decodes_to_max_new_tokens(tiny):
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    plain = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=16)[0, length:].tolist()
    tiny.policy = get_policy("chain")
    stops = tiny(image, prompt, max_new_tokens=16, eos_token_id=plain[2]).token_ids
    assert len(stops) == plain.index(plain[2]) + 1 < len(plain) == 16
    assert tiny(image, prompt, max_new_tokens=16, eos_token_id=[]).token_ids == plain


def test_the_config_s_min_length_counts_the_prompt(tiny, config_of):
    """min_length counts prompt + new tokens: with the prompt's length + 2, EOS may end the reply from its third
    token on, as in generate()."""
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    plain = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=16)[0, length:].tolist()
    eos = next(t for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])  # first seen from token 3 on
    config_of.min_length = length + 2
    call = {"eos_token_id": eos, "max_new_tokens": 16}
    expected = tiny.target.generate(**inputs, do_sample=False, **call)[0, length:].tolist()
    tiny.policy = get_policy("chain")
    assert tiny(image, prompt, **call).token_ids == expected == plain[: plain.index(eos) + 1]


def test_tau_counts_only_the_accepted_tokens_emitted_before_a_stop(mini):
    """A stop condition that ends a step inside its accepted path: the tokens after it are not emitted, so they do
    not count as accepted either."""
    example = sample("image_caption", 1)
    mini.policy = get_policy("chain")
    free = mini(example.image, example.prompt, max_new_tokens=40)
    assert free.stats.accepted_tokens > free.stats.steps  # several tokens accepted per step
    stop = free.token_ids[1]
    cut = mini(example.image, example.prompt, max_new_tokens=40, eos_token_id=stop)
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    assert cut.stats.accepted_tokens <= cut.stats.new_tokens - 1


def test_generate_s_none_and_length_arguments_follow_generate(tiny, config_of):
    """Review findings: a None turns a config setting off as in generate() (min_length, which bans EOS); a call's
    max_length counts the prompt; the config's empty EOS list decodes with no EOS; pad_token_id=None pads with the
    EOS, not the config's pad token; return_dict_in_generate=None is off."""
    image, prompt = make_image(0), "Describe this image."
    inputs = tiny.prepare_inputs(image, prompt)
    length = inputs["input_ids"].shape[1]
    tiny.policy = get_policy("chain")
    free = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=8)[0, length:].tolist()
    config_of.min_length, config_of.eos_token_id = (
        length + 6,
        free[1],
    )  # EOS banned for the first 6 new tokens
    banned = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=8)[0, length:].tolist()
    off = tiny.generate(**inputs, min_length=None, max_new_tokens=8)[0, length:].tolist()
    assert off == tiny.target.generate(**inputs, min_length=None, max_new_tokens=8)[0, length:].tolist()
    assert len(off) <= 2 < 6 <= len(banned)  # the EOS ended the reply only with the config's min_length off
    assert tiny.generate(**inputs, max_new_tokens=8)[0, length:].tolist() == banned
    config_of.min_length, config_of.eos_token_id = None, None
    expected = tiny.target.generate(**inputs, do_sample=False, max_length=length + 6)[0, length:].tolist()
    assert (
        tiny.generate(**inputs, max_length=length + 6)[0, length:].tolist() == expected and len(expected) == 6
    )
    config_of.eos_token_id, config_of.pad_token_id = [], 0
    expected = tiny.target.generate(**inputs, do_sample=False, max_new_tokens=9)[0, length:].tolist()
    assert tiny.generate(**inputs, max_new_tokens=9)[0, length:].tolist() == expected and len(expected) == 9
    config_of.return_dict_in_generate = True
    assert torch.is_tensor(tiny.generate(**inputs, max_new_tokens=2, return_dict_in_generate=None))
    config_of.return_dict_in_generate, config_of.eos_token_id = False, None

    texts = image_and_text_prompts(tiny.processor, prompt)
    alone = [tiny.generate(**inputs, max_new_tokens=12)[0, length:].tolist()]
    text_only = tiny.processor(text=texts[1:], return_tensors="pt")
    alone.append(tiny.generate(**text_only, max_new_tokens=12)[0, text_only["input_ids"].shape[1] :].tolist())
    eos = next(t for t in alone[0][1:6] if t not in alone[1])  # ends row 0 early, never row 1
    config_of.pad_token_id = next(t for t in range(3, 50) if t != eos)
    batch = tiny.processor(text=texts, images=[[image], []], padding=True, return_tensors="pt")
    ids = tiny.generate(**batch, max_new_tokens=12, eos_token_id=eos, pad_token_id=None)
    row = ids[0, batch["input_ids"].shape[1] :].tolist()
    stop = alone[0].index(eos) + 1
    assert row[:stop] == alone[0][:stop] and row[stop:] == [eos] * (12 - stop)


def test_min_new_tokens_none_keeps_the_config_s_min_length():
    """generate(min_new_tokens=None) turns the config's min_new_tokens off; its min_length (prompt included) still
    bans EOS: 12 - 10 = 2 new tokens."""
    from transformers import GenerationConfig

    config = GenerationConfig(min_new_tokens=5, min_length=12, do_sample=False)
    assert (
        hf_compat.resolve_options({"min_new_tokens": None}, config, prompt_length=10)["min_new_tokens"] == 2
    )
