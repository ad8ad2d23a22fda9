"""Every other logits processor of ``generate()`` (n-gram bans, bad words, sequence bias, forced EOS, length decay,
the prompt-side ones) and a call's own ``logits_processor`` / ``prefix_allowed_tokens_fn``: transformers' list run
node by node over the tree keeps the output ``generate()``'s (:mod:`vlmspec.node_processors`)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    EosTokenCriteria,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    MaxTimeCriteria,
    NoRepeatNGramLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from vlmspec import InputTypeError, InvalidInputError, VLMSpecPipeline, get_policy
from vlmspec.testbed import sample

NEW = 40


@pytest.fixture(scope="module")
def mini():
    return VLMSpecPipeline.from_pretrained("testbed-mini", policy="sage")


@pytest.fixture(scope="module")
def prompt(mini):
    """An image caption's inputs, its prompt length and the target's plain greedy caption."""
    example = sample("image_caption", 1)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    length = inputs["input_ids"].shape[1]
    plain = mini.target.generate(**inputs, do_sample=False, max_new_tokens=NEW)[0, length:].tolist()
    return example, inputs, length, plain


def settings_for(plain: list[int]) -> dict[str, dict]:
    """One setting per processor, chosen from the plain caption so that each changes it."""
    return {
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "bad_words_ids": {"bad_words_ids": [[plain[3]], plain[6:8]]},
        "sequence_bias": {"sequence_bias": {(plain[2],): -20.0, tuple(plain[4:6]): -20.0}},
        "forced_eos_token_id": {"forced_eos_token_id": plain[0]},
        "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (5, 1.5)},
        "encoder_repetition_penalty": {"encoder_repetition_penalty": 1.5},
        "encoder_no_repeat_ngram_size": {"encoder_no_repeat_ngram_size": 2},
    }


@pytest.mark.parametrize("name", list(settings_for(list(range(10)))))
def test_each_processor_of_a_call_keeps_the_tree_output_generate_s(mini, prompt, name):
    example, inputs, length, plain = prompt
    setting = settings_for(plain)[name]
    new = NEW if name != "forced_eos_token_id" else 12  # forced EOS acts at the last token
    expected = mini.target.generate(**inputs, do_sample=False, max_new_tokens=new, **setting)[
        0, length:
    ].tolist()
    assert expected != plain[:new]  # the processor changed the caption
    for policy in ("sage", "chain"):
        mini.policy = get_policy(policy)
        assert mini.generate(**inputs, max_new_tokens=new, **setting)[0, length:].tolist() == expected, policy


def test_a_checkpoint_s_processors_apply_to_pipe_calls_greedy_and_sampled(mini, prompt):
    """Set in the target's generation_config, the processors reach pipe(...) too; sampling with top_k=1 draws the
    processed argmax; several draft tokens are still accepted per step."""
    example, inputs, length, plain = prompt
    config = mini.target.generation_config
    saved = copy.deepcopy(config)
    config.no_repeat_ngram_size, config.bad_words_ids = 2, [[plain[3]]]
    try:
        expected = mini.target.generate(**inputs, do_sample=False, max_new_tokens=NEW)[0, length:].tolist()
        mini.policy = get_policy("sage")
        out = mini(example.image, example.prompt, max_new_tokens=NEW)
        assert out.token_ids == expected != plain
        assert out.stats.accepted_tokens > out.stats.steps  # trees, not one token per step
        drawn = mini(example.image, example.prompt, max_new_tokens=NEW, do_sample=True, top_k=1, seed=1)
        assert drawn.token_ids == expected
    finally:
        mini.target.generation_config = saved


class BanAfter(LogitsProcessor):
    """Bans ``banned`` right after ``after``: a function of the ids, as generate()'s processors are."""

    def __init__(self, after: int, banned: int) -> None:
        self.after, self.banned = after, banned

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        scores[input_ids[:, -1] == self.after, self.banned] = float("-inf")
        return scores


def test_a_call_s_own_processors_and_prefix_function_see_each_row_as_generate_does(mini, prompt):
    """``logits_processor`` and ``prefix_allowed_tokens_fn`` (called with the row of the batch, as generate()
    calls it): each row of a two-prompt batch equals generate() on that prompt with its row's constraints."""
    example, inputs, length, plain = prompt
    ban = LogitsProcessorList([BanAfter(plain[4], plain[5])])
    expected = mini.target.generate(**inputs, do_sample=False, max_new_tokens=NEW, logits_processor=ban)
    assert expected[0, length:].tolist() != plain
    assert torch.equal(mini.generate(**inputs, max_new_tokens=NEW, logits_processor=ban), expected)

    allowed = sorted(set(plain))
    rows = {0: allowed, 1: [t for t in allowed if t != plain[3]]}  # row 1 may not say plain[3]
    batch = {name: torch.cat([value, value]) for name, value in inputs.items()}  # the prompt twice
    out = mini.generate(**batch, max_new_tokens=NEW, prefix_allowed_tokens_fn=lambda b, ids: rows[b])
    for b in (0, 1):
        alone = mini.target.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=NEW,
            prefix_allowed_tokens_fn=lambda _, ids, b=b: rows[b],
        )[0, length:].tolist()
        assert out[b, length : length + len(alone)].tolist() == alone
    assert out[0, length:].tolist() != out[1, length:].tolist()


def test_scores_are_generate_s_under_a_node_processor(mini, prompt):
    example, inputs, length, plain = prompt
    mini.policy = get_policy("sage")
    options = {"max_new_tokens": 16, "no_repeat_ngram_size": 2, "return_dict_in_generate": True}
    theirs = mini.target.generate(**inputs, do_sample=False, output_scores=True, **options)
    ours = mini.generate(**inputs, output_scores=True, **options)
    assert torch.equal(ours.sequences, theirs.sequences) and len(ours.scores) == len(theirs.scores)
    for a, b in zip(ours.scores, theirs.scores, strict=True):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(a[torch.isfinite(b)], b[torch.isfinite(b)], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"logits_processor": "ban"},
            r"logits_processor='ban' is invalid: use a transformers LogitsProcessorList",
        ),
        ({"logits_processor": [3]}, r"logits_processor holds 3, which is not callable"),
        ({"prefix_allowed_tokens_fn": [1, 2]}, r"prefix_allowed_tokens_fn=\[1, 2\], which is not callable"),
        ({"stopping_criteria": [None]}, r"stopping_criteria holds None, which is not callable"),
    ],
)
def test_a_call_s_processors_that_are_not_callables_are_refused_by_name(mini, prompt, options, message):
    _, inputs, _, _ = prompt
    with pytest.raises(InputTypeError, match=message):
        mini.generate(**inputs, max_new_tokens=2, **options)


class StopAfter(StoppingCriteria):
    """Stops once ``token`` was generated."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
        return input_ids[:, -1] == self.token


def test_a_call_s_stopping_criteria_end_the_output_where_generate_ends_it(mini, prompt):
    """Checked after each token of a step, with the whole sequence, so a step's accepted tokens are cut at the
    same token as generate() stops at."""
    _, inputs, length, plain = prompt
    mini.policy = get_policy("sage")
    for criteria in (
        StoppingCriteriaList([StopAfter(plain[7])]),
        [StopStringCriteria(mini.tokenizer, [mini.tokenizer.decode(plain[8:10])])],
    ):
        expected = mini.target.generate(
            **inputs, do_sample=False, max_new_tokens=NEW, stopping_criteria=criteria
        )
        assert 8 <= expected.shape[1] - length < len(plain)
        assert torch.equal(mini.generate(**inputs, max_new_tokens=NEW, stopping_criteria=criteria), expected)


def test_max_time_stops_as_generate_s_max_time_criteria_stops(mini, prompt):
    """generate()'s max_time: no token after the limit (0 s: the first token only), none without one; set on the
    call or in the target's generation_config."""
    example, inputs, length, plain = prompt
    for limit, expected in ((0.0, plain[:1]), (600.0, plain)):
        theirs = mini.target.generate(**inputs, do_sample=False, max_new_tokens=NEW, max_time=limit)
        assert theirs[0, length:].tolist() == expected
        assert torch.equal(mini.generate(**inputs, max_new_tokens=NEW, max_time=limit), theirs)
    config = mini.target.generation_config
    config.max_time = 0.0
    try:
        assert mini(example.image, example.prompt, max_new_tokens=NEW).token_ids == plain[:1]
    finally:
        config.max_time = None
    with pytest.raises(ValueError, match=r"max_time='1' is invalid: use a number of seconds >= 0"):
        mini.generate(**inputs, max_new_tokens=2, max_time="1")


class ConfidentOnly(StoppingCriteria):
    """Stops once the last token's processed probability is below one half: reads the scores generate() gives."""

    def __call__(self, input_ids: torch.Tensor, scores: tuple | None, **kwargs) -> torch.Tensor:
        assert scores is not None and len(scores) == input_ids.shape[1] - self.length
        return scores[-1].softmax(-1).max(-1).values < 0.5

    def __init__(self, length: int) -> None:
        self.length = length


def test_criteria_get_the_scores_so_far_and_prefix_functions_the_prompt_s_batch_id(mini, prompt):
    example, inputs, length, plain = prompt
    mini.policy = get_policy("sage")
    options = {"max_new_tokens": NEW, "return_dict_in_generate": True, "output_scores": True}
    criteria = StoppingCriteriaList([ConfidentOnly(length)])
    theirs = mini.target.generate(**inputs, do_sample=False, stopping_criteria=criteria, **options)
    assert theirs.sequences.shape[1] - length < len(plain)  # the criterion ended it
    assert torch.equal(
        mini.generate(**inputs, stopping_criteria=criteria, **options).sequences, theirs.sequences
    )

    seen: set[int] = set()
    allowed = {0: sorted(set(plain))}  # keyed by prompt, as generate() calls it with num_return_sequences

    def prefix(batch_id: int, ids: torch.Tensor) -> list[int]:
        seen.add(batch_id)
        return allowed[batch_id]

    mini.generate(
        **inputs, max_new_tokens=6, do_sample=True, num_return_sequences=3, prefix_allowed_tokens_fn=prefix
    )
    assert seen == {0}


@pytest.mark.parametrize(
    ("criteria", "options", "message"),
    [
        (
            lambda length: MaxLengthCriteria(length + 20),
            {},
            r"holds a MaxLengthCriteria.*pass max_new_tokens",
        ),
        (lambda length: EosTokenCriteria(5), {}, r"holds a EosTokenCriteria.*pass eos_token_id"),
        (lambda length: MaxTimeCriteria(9.0), {"max_time": 5.0}, r"holds a MaxTimeCriteria.*pass max_time"),
    ],
)
def test_a_criterion_generate_would_put_in_place_of_its_own_is_refused(
    mini, prompt, criteria, options, message
):
    """generate() replaces its own criterion of the same type with the caller's; vlmspec says which argument to
    pass instead of silently keeping both."""
    _, inputs, length, _ = prompt
    with pytest.raises(InvalidInputError, match=message):
        mini.generate(**inputs, max_new_tokens=8, stopping_criteria=[criteria(length)], **options)


class PerRowBias(LogitsProcessor):
    """Built for a batch of two: returns two rows whatever it is given."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores + torch.zeros(2, 1)


def test_settings_pipe_takes_from_the_config_only_are_taken_from_the_call_too(mini, prompt):
    """suppress_tokens, begin_suppress_tokens, min_length, forced_bos_token_id given to pipe.generate apply as in
    generate() (one-token text prompt for the forced BOS); a processor built for a whole batch is refused."""
    _, inputs, length, plain = prompt
    for setting in (
        {"suppress_tokens": [plain[1]]},
        {"begin_suppress_tokens": [plain[0]]},
        {"min_length": length + len(plain) + 3, "eos_token_id": plain[-1]},
    ):
        expected = mini.target.generate(**inputs, do_sample=False, max_new_tokens=NEW, **setting)
        assert expected[0, length:].tolist() != plain
        assert torch.equal(mini.generate(**inputs, max_new_tokens=NEW, **setting), expected), setting
    one = {"input_ids": inputs["input_ids"][:, :1], "attention_mask": inputs["attention_mask"][:, :1]}
    expected = mini.target.generate(**one, do_sample=False, max_new_tokens=6, forced_bos_token_id=plain[3])
    assert expected[0, 1].item() == plain[3]
    assert torch.equal(mini.generate(**one, max_new_tokens=6, forced_bos_token_id=plain[3]), expected)
    with pytest.raises(InvalidInputError, match=r"returned scores of shape \(2, \d+\) for one sequence"):
        mini.generate(**inputs, max_new_tokens=4, logits_processor=[PerRowBias()])


def test_max_time_counts_from_the_start_it_is_given():
    """pipe.generate's rows count max_time from the call's start, not each from its own."""
    import time

    from vlmspec.stopping import StopCriteria

    ids = torch.tensor([5, 6, 7])
    late = StopCriteria(max_new_tokens=50, max_time=5.0, started=time.time() - 10).after_prompt(ids)
    fresh = StopCriteria(max_new_tokens=50, max_time=5.0).after_prompt(ids)
    assert late.update([1, 2]) and not fresh.update([1, 2])


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        ({"num_beams": "2"}, InputTypeError, r"num_beams='2' is invalid: not a value generate\(\) takes"),
        ({"no_repeat_ngram_size": "3"}, InputTypeError, r"no_repeat_ngram_size='3' is invalid"),
        ({"exponential_decay_length_penalty": 5}, InvalidInputError, r"processors refuse these settings"),
        ({"bad_words_ids": [[-1]]}, InvalidInputError, r"processors refuse these settings \(bad_words_ids\)"),
    ],
)
def test_a_bad_value_of_a_processor_setting_is_refused_before_any_model_work(
    mini, prompt, setting, error, message
):
    """The settings' types are checked, and transformers' processors built once, while the request is prepared."""
    _, inputs, _, _ = prompt
    calls = []
    hook = mini.target.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(error, match=message):
            mini.generate(**inputs, max_new_tokens=4, **setting)
    finally:
        hook.remove()
    assert not calls  # refused before the prefill


def test_criteria_get_scores_only_with_output_scores_and_a_one_token_prompt_gets_its_forced_bos(mini, prompt):
    _, inputs, length, plain = prompt
    seen = []

    def record(ids: torch.Tensor, scores: tuple | None) -> torch.Tensor:
        seen.append(scores is None)
        return torch.zeros(1, dtype=torch.bool)

    options = {"max_new_tokens": 4, "return_dict_in_generate": True, "stopping_criteria": [record]}
    mini.generate(**inputs, output_logits=True, **options)
    assert seen and all(seen)  # generate() hands criteria no scores without output_scores
    seen.clear()
    mini.generate(**inputs, output_scores=True, **options)
    assert seen and not any(seen)
    one = {"input_ids": inputs["input_ids"][:, :1], "attention_mask": inputs["attention_mask"][:, :1]}
    config = mini.target.generation_config
    config.forced_bos_token_id = plain[3]
    try:  # the built-in path (no other processor on)
        expected = mini.target.generate(**one, do_sample=False, max_new_tokens=6)
        assert expected[0, 1].item() == plain[3] and torch.equal(
            mini.generate(**one, max_new_tokens=6), expected
        )
    finally:
        config.forced_bos_token_id = None


EOS = 3
TREES = {  # parents, tokens: three nodes at each depth 1..3
    "interleaved": ([-1, 0, 1, 0, 2, 3, 0, 2, 6, 5], [7, 5, 6, 8, 7, 8, 9, 6, 5, 8]),
    "level by level": (
        [-1, 0, 0, 0, 1, 1, 3, 4, 4, 6],
        [7, 5, 8, 9, 6, 8, 5, 7, 6, 8],
    ),  # as drafting orders them
}
SO_FAR = [5, 6, 7, 8, 5, 9, 6, 8, 7]  # the prompt (its first 6) and three emitted tokens, the root last


def node_logits(mini, settings: dict, custom=None):
    """A request's :class:`NodeLogits` over :data:`SO_FAR` for ``settings`` (7 new tokens: forced EOS at
    depth 3)."""
    from vlmspec.processors import LogitsProcessing
    from vlmspec.requests import CallHooks

    config = copy.deepcopy(mini.target.generation_config)
    for name, value in settings.items():
        setattr(config, name, value)
    hooks = None if custom is None else CallHooks(**custom)
    processing = LogitsProcessing.for_call(config, [EOS], model=mini.target, max_new_tokens=7, custom=hooks)
    node = processing.start(torch.tensor(SO_FAR[:6]), 0)
    node.commit(torch.tensor(SO_FAR[6:]))
    return node


def hand_tree(name: str = "interleaved"):
    from vlmspec.tree import TokenTree

    parents, tokens = (torch.tensor(values) for values in TREES[name])
    return TokenTree(tokens=tokens, parents=parents, draft_probs=torch.ones(len(tokens)))


class Recording(LogitsProcessorList):
    """A processor list that records the shape of the ``input_ids`` of each pass."""

    def __init__(self, processors: LogitsProcessorList) -> None:
        super().__init__(processors)
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.shapes.append(tuple(input_ids.shape))
        return super().__call__(input_ids, scores, **kwargs)


EVERY_ROW_WISE = {
    "no_repeat_ngram_size": 2,
    "bad_words_ids": [[8, 5]],
    "sequence_bias": {(6, 7): -5.0, (9,): 2.0},
    "repetition_penalty": 1.3,
    "min_new_tokens": 5,  # EOS banned at depths 0 and 1
    "forced_eos_token_id": EOS,
    "exponential_decay_length_penalty": (4, 1.5),  # from depth 2
    "remove_invalid_values": True,
    "suppress_tokens": [11],
    "begin_suppress_tokens": [12],
    "encoder_repetition_penalty": 1.5,
    "encoder_no_repeat_ngram_size": 2,
}


@pytest.mark.parametrize(
    ("settings", "custom", "by_depth"),
    [
        ({"no_repeat_ngram_size": 2}, None, True),
        (EVERY_ROW_WISE, None, True),
        ({"no_repeat_ngram_size": 2}, {"logits_processor": [BanAfter(5, 6)]}, False),
        (
            {},
            {"logits_processor": [NoRepeatNGramLogitsProcessor(2)]},
            False,
        ),  # the caller's, even of the list
        ({}, {"prefix_allowed_tokens_fn": lambda b, ids: [5, 6, 7]}, False),
        ({"no_repeat_ngram_size": 2, "encoder_repetition_penalty": 1.5}, None, True),
        ({"encoder_no_repeat_ngram_size": 2}, None, True),
    ],
)
def test_a_row_wise_list_runs_once_per_depth_any_other_once_per_node(mini, settings, custom, by_depth):
    node = node_logits(mini, settings, custom)
    assert node.by_depth == by_depth
    node.processors = Recording(node.processors)
    tree = hand_tree()
    node.tree(torch.randn(tree.tokens.shape[0], 699), tree, len(SO_FAR) - 6)
    depths = tree.depths.tolist()
    if by_depth:  # one pass per depth, its nodes as a batch
        expected = [(depths.count(d), len(SO_FAR) + d) for d in sorted(set(depths))]
    else:
        expected = [(1, len(SO_FAR) + d) for d in depths]
    assert node.processors.shapes == expected


@pytest.mark.parametrize("shape", list(TREES))
def test_by_depth_gives_each_node_the_scores_node_by_node_gives(mini, shape):
    """Every allowlisted processor on, on a tree of three nodes per depth whose siblings end different
    n-grams: the same numbers, bit for bit, as a batch of one per node; the logits given are left as they
    were."""
    batched = node_logits(mini, EVERY_ROW_WISE)
    alone = node_logits(mini, EVERY_ROW_WISE)
    alone.by_depth = False
    tree = hand_tree(shape)
    logits = torch.randn(tree.tokens.shape[0], 699, generator=torch.Generator().manual_seed(0))
    logits[2, 20], logits[5, 21] = float("inf"), float("nan")  # for remove_invalid_values
    given = logits.clone()
    ours = batched.tree(logits, tree, 3)
    theirs = alone.tree(logits, tree, 3)
    assert batched.by_depth and torch.equal(ours, theirs)
    assert torch.equal(logits.nan_to_num(), given.nan_to_num())
    banned, depth = ours < -1e30, tree.depths  # -inf, or the least float where remove_invalid_values put it
    assert all(
        len({tuple(row) for row in banned[depth == d].tolist()}) == 3 for d in (1, 2)
    )  # siblings differ
    assert (banned[depth == 3].sum(-1) == logits.shape[1] - 1).all() and (ours[depth == 3, EOS] == 0).all()
    assert banned[depth < 2, EOS].all() and not banned[depth == 2, EOS].any()  # minimum new tokens
    assert ours[2, 20] == torch.finfo(torch.float32).max and not ours.isnan().any()


def test_the_row_wise_allowlist_is_by_exact_class_and_per_row_data():
    from transformers import RepetitionPenaltyLogitsProcessor

    from vlmspec.node_processors import is_row_wise

    class MyBans(NoRepeatNGramLogitsProcessor):
        pass

    assert is_row_wise(NoRepeatNGramLogitsProcessor(2)) and not is_row_wise(MyBans(2))
    assert is_row_wise(RepetitionPenaltyLogitsProcessor(1.2))
    assert not is_row_wise(RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=torch.tensor([0])))
    assert not is_row_wise(BanAfter(1, 2))


def test_a_pipe_call_with_a_row_wise_processor_batches_each_depth(mini, prompt, monkeypatch):
    """End to end: the verifications pass several nodes at once, and the output is still generate()'s."""
    _, inputs, length, _ = prompt
    batches = []
    run = LogitsProcessorList.__call__

    def recording(self, input_ids, scores, **kwargs):
        batches.append(input_ids.shape[0])
        return run(self, input_ids, scores, **kwargs)

    options = {"max_new_tokens": NEW, "no_repeat_ngram_size": 2, "repetition_penalty": 1.2}
    expected = mini.target.generate(**inputs, do_sample=False, **options)
    monkeypatch.setattr(LogitsProcessorList, "__call__", recording)
    mini.policy = get_policy("sage")
    assert torch.equal(mini.generate(**inputs, **options), expected)
    assert max(batches) > 1
