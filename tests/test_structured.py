"""Structured outputs (:mod:`vlmspec.structured`): a reply that follows a JSON schema, a regular expression, a list
of choices or a grammar is the target's own under that constraint, as ``generate()`` decodes it with xgrammar's
own logits processor; sampled replies follow the target's masked distribution; the draft proposes only what the
structure allows; bad structures are refused naming the field."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest
import torch
import xgrammar
from conftest import make_image
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from vlmspec import InputTypeError, InvalidInputError, StructuredOutputs, VLMSpecPipeline, get_policy
from vlmspec.cli import main as cli_main
from vlmspec.draft import DraftTree, logits_width
from vlmspec.structured import GrammarGuide, compile_structured
from vlmspec.testbed import sample
from vlmspec.testing import FAMILIES

POLICIES = ("ar", "chain", "static", "sage", "eagle2", "pct", "c2t")
SCHEMA = {
    "type": "object",
    "properties": {"shapes": {"enum": [1, 2, 3]}, "caption": {"type": "string", "maxLength": 60}},
    "required": ["shapes", "caption"],
}
STRUCTURES = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "regex": {"regex": r"The image shows (one|two|three) shapes?\. [a-z ]+\."},
    "choice": {"choice": ["circle", "square", "triangle", "a star"]},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
    "grammar": {"grammar": 'root ::= "shapes: " [0-9] ", colour: " ("red" | "blue" | [a-z]+)'},
}


def grammar_of(pipe: VLMSpecPipeline, structure: dict, eos=None):
    eos = pipe.target.generation_config.eos_token_id if eos is None else eos
    eos = [eos] if isinstance(eos, int) else eos
    return compile_structured(StructuredOutputs.of(structure), pipe.tokenizer, logits_width(pipe.target), eos)


def reference(
    pipe: VLMSpecPipeline, inputs: dict, structure: dict, max_new_tokens: int, **options
) -> list[int]:
    """The target's own ``generate()`` with xgrammar's logits processor for transformers."""
    processor = xgrammar.contrib.hf.LogitsProcessor(grammar_of(pipe, structure).compiled)
    out = pipe.target.generate(
        **inputs, max_new_tokens=max_new_tokens, logits_processor=[processor], do_sample=False, **options
    )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def mini():
    return VLMSpecPipeline.from_pretrained("testbed-mini", policy="ar")


@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_every_policy_s_structured_reply_is_generate_s_with_xgrammar_s_processor(mini, kind):
    structure = STRUCTURES[kind]
    example = sample("image_caption", 3)
    inputs = mini.prepare_inputs(example.image, example.prompt)
    expected = reference(mini, inputs, structure, 64)
    text = mini.tokenizer.decode(expected, skip_special_tokens=True)
    if kind == "json":
        assert list(json.loads(text)) == ["shapes", "caption"]  # complete, valid, in the schema's order
    plain = mini(example.image, example.prompt, max_new_tokens=64).token_ids
    assert expected != plain
    for policy in POLICIES:
        mini.policy = get_policy(policy)
        out = mini(example.image, example.prompt, max_new_tokens=64, structured_outputs=structure)
        assert out.token_ids == expected, (kind, policy)
        assert out.text == text
    mini.policy = get_policy("ar")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_s_structured_reply_is_the_target_s_own(tiny_pairs, family):
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    image, prompt = make_image(1), "Describe this image."
    inputs = pipe.prepare_inputs(image, prompt)
    structure = {"regex": r"[a-z]{2,6}( [a-z]{1,5}){2,4}\."}
    expected = reference(pipe, inputs, structure, 24)
    for policy in ("sage", "static", "eagle2"):
        pipe.policy = get_policy(policy)
        assert pipe(image, prompt, max_new_tokens=24, structured_outputs=structure).token_ids == expected, (
            policy
        )


def test_a_batch_mixes_structured_and_free_requests_each_its_own(mini):
    examples = [sample("image_caption", seed) for seed in (3, 4, 3, 4)]
    structures = [STRUCTURES["json"], STRUCTURES["regex"], None, STRUCTURES["json"]]
    requests, expected = [], []
    for example, structure in zip(examples, structures, strict=True):
        request = {"image": example.image, "prompt": example.prompt, "max_new_tokens": 48}
        inputs = mini.prepare_inputs(example.image, example.prompt)
        if structure is None:
            length = inputs["input_ids"].shape[1]
            expected.append(
                mini.target.generate(**inputs, do_sample=False, max_new_tokens=48)[0, length:].tolist()
            )
        else:
            request["structured_outputs"] = structure
            expected.append(reference(mini, inputs, structure, 48))
        requests.append(request)
    mini.policy = get_policy("sage")
    assert [row.token_ids for row in mini.batch(requests, batch_size=4)] == expected
    streamed = "".join(piece.text for piece in mini.stream(**requests[0]))
    assert streamed == mini.tokenizer.decode(expected[0], skip_special_tokens=True)
    mini.policy = get_policy("ar")


def test_sampled_choices_follow_the_target_s_masked_distribution(tiny_pairs):
    """Every token sequence the structure allows, with its exact probability under the target's masked
    distribution (enumerated with xgrammar's matcher), against 400 seeded speculative draws: chi-square."""
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    structure = {"choice": ["ab", "ba", "abc", "c"]}
    prompt_ids = pipe.prepare_inputs(None, "Pick one.")["input_ids"]
    exact = _sequence_probs(pipe, prompt_ids, grammar_of(pipe, structure))
    assert len(exact) >= 5 and math.isclose(sum(exact.values()), 1.0, abs_tol=1e-4)
    draws = Counter(
        tuple(
            pipe(
                prompt="Pick one.",
                max_new_tokens=8,
                structured_outputs=structure,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                seed=seed,
            ).token_ids
        )
        for seed in range(400)
    )
    assert set(draws) <= set(exact)
    common = sorted((p, seq) for seq, p in exact.items() if p * 400 >= 5)
    observed = [draws[seq] for _, seq in common] + [400 - sum(draws[seq] for _, seq in common)]
    expected = [p * 400 for p, _ in common] + [400 * (1 - sum(p for p, _ in common))]
    if expected[-1] < 1e-6:
        observed, expected = observed[:-1], expected[:-1]
    assert len(common) >= 2 and chisquare(observed, expected).pvalue > 1e-3


def _sequence_probs(pipe, prompt_ids, grammar) -> dict[tuple[int, ...], float]:
    """Each complete reply (EOS included) the grammar allows, with its probability under the target's logits
    masked by the grammar (temperature 1, no other warper)."""
    out, stack = {}, [((), 1.0)]
    while stack:
        sequence, p = stack.pop()
        matcher = xgrammar.GrammarMatcher(grammar.compiled)
        assert all(matcher.accept_token(t) for t in sequence)
        if matcher.is_terminated():
            out[sequence] = p
            continue
        ids = torch.cat([prompt_ids, torch.tensor([sequence], dtype=torch.long)], dim=1)
        logits = pipe.target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1].float()
        bitmask = xgrammar.allocate_token_bitmask(1, grammar.width)
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits[None], bitmask)
        probs = torch.softmax(logits, -1)
        for token in torch.nonzero(probs > 1e-9).flatten().tolist():
            stack.append(((*sequence, token), p * probs[token].item()))
    return out


def test_the_draft_proposes_only_what_the_structure_allows(mini, monkeypatch):
    """Every verified path the draft gave a probability is one the structure allows."""
    trees = []
    original = GrammarGuide.tree

    def keep(self, logits, tree):
        trees.append((tree, self.matcher.fork()))
        return original(self, logits, tree)

    monkeypatch.setattr(GrammarGuide, "tree", keep)
    example = sample("image_caption", 3)
    mini.policy = get_policy("static")
    out = mini(example.image, example.prompt, max_new_tokens=48, structured_outputs=STRUCTURES["json"])
    mini.policy = get_policy("ar")
    assert trees and out.stats.mean_accepted > 1
    proposed = 0
    for tree, matcher in trees:
        parents, tokens, probs = tree.parents.tolist(), tree.tokens.tolist(), tree.draft_probs.tolist()
        for node in range(1, len(tokens)):
            if all(probs[i] > 0 for i in _path(parents, node)):  # a path the draft proposed
                path = [tokens[i] for i in _path(parents, node)]
                assert all(matcher.accept_token(token) for token in path), (node, path)
                matcher.rollback(len(path))
                proposed += 1
    assert proposed > len(trees)


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


class _OnlyEvenTokens:
    def allowed(self, tokens, parents, nodes):
        allowed = torch.zeros(nodes.shape[0], 699, dtype=torch.bool)
        allowed[:, ::2] = True
        allowed[nodes == 0] = False  # the root allows nothing: its distribution is left whole
        return allowed


def test_a_draft_constraint_renormalises_over_the_allowed_and_leaves_a_row_allowing_none(mini):
    adapter = mini.draft_adapter
    inputs = mini.prepare_inputs(None, "Describe this image.")
    state = adapter.prefill(inputs).state
    root = torch.tensor(5)
    builder = DraftTree(adapter, state, root, inputs["input_ids"].shape[1], torch.zeros(0, dtype=torch.long), 8,
                        vocab=mini._draft_vocab, constraint=_OnlyEvenTokens())  # fmt: skip
    at_root = builder.next_probs(torch.tensor([0]))
    assert at_root[0, 1::2].sum() > 0  # nothing allowed: unmasked
    child = builder.add(torch.tensor([0]), torch.tensor([6]), at_root[0, 6:7])
    below = builder.next_probs(child)
    assert below[0, 1::2].sum() == 0 and math.isclose(below[0].sum().item(), 1.0, rel_tol=1e-5)


@pytest.mark.parametrize(
    "fields, error, words",
    [
        ({}, InvalidInputError, "sets nothing"),
        ({"regex": "a", "choice": ["a"]}, InvalidInputError, "regex and choice"),
        ({"json": "{not json"}, InvalidInputError, "not JSON text"),
        ({"json": [1, 2]}, InputTypeError, "use a JSON schema"),
        ({"choice": "yes"}, InputTypeError, "non-empty list of strings"),
        ({"choice": ["yes", ""]}, InputTypeError, "every choice"),
        ({"regex": 3}, InputTypeError, "non-empty string"),
        ({"json_object": "yes"}, InputTypeError, "True/False"),
        (
            {"regex": "a", "disable_any_whitespace": True},
            InvalidInputError,
            "for json and json_object, not regex",
        ),
        ({"regx": "a"}, InputTypeError, "did you mean 'regex'"),
    ],
)
def test_bad_structures_are_refused_naming_the_field(fields, error, words):
    with pytest.raises(error, match=words):
        StructuredOutputs.of(fields)


@pytest.mark.parametrize(
    "structure, words",
    [
        ({"regex": "(ab"}, r"structured_outputs.regex='\(ab' cannot be compiled"),
        ({"json": {"type": "frob"}}, "structured_outputs.json=.*cannot be compiled: Unsupported type"),
        ({"grammar": "root ::= x"}, 'structured_outputs.grammar=.*Rule "x" is not defined'),
    ],
)
def test_structures_xgrammar_cannot_compile_are_refused_before_decoding(mini, structure, words):
    with pytest.raises(InvalidInputError, match=words):
        mini(prompt="Hi.", structured_outputs=structure)


def test_structure_conflicts_are_refused_with_what_to_do(mini):
    with pytest.raises(InvalidInputError, match=r"needs an EOS token .*eos_token_id=\[\]"):
        mini(prompt="Hi.", structured_outputs={"choice": ["a"]}, eos_token_id=[])
    with pytest.raises(InvalidInputError, match="banned every token it allows"):
        mini(prompt="Hi.", structured_outputs={"choice": ["a"]}, min_new_tokens=4)
    with pytest.raises(InputTypeError, match="structured_outputs=.*use a StructuredOutputs or a dict"):
        mini(prompt="Hi.", structured_outputs="json")


def test_the_demo_captions_under_a_structure_identical_to_generate_s(capsys):
    assert (
        cli_main(
            ["demo", "--pair", "testbed-mini", "--choice", "a circle, a square", "--max-new-tokens", "8"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert (
        re.search(r"caption: +a (circle|square)\n", printed) and "output vs generate(): identical" in printed
    )
    assert "scene facts" not in printed


def test_choices_with_any_characters_are_each_reachable(mini):
    """An emoji (beyond U+FFFF), quotes, backslashes and tabs: each choice is a reply the structure allows."""
    choices = ["\U0001f600 yes", 'say "no"', "back\\slash", "tab\there"]
    for choice in choices:
        guide = grammar_of(mini, {"choice": choices}).start()
        guide.commit(mini.tokenizer.encode(choice, add_special_tokens=False))
        assert guide.matcher.is_completed(), choice
    out = mini(prompt="Hi.", max_new_tokens=16, structured_outputs={"choice": choices[:1]})
    assert out.text == choices[0]


def test_a_grammar_that_allows_no_reply_says_so(mini):
    with pytest.raises(InvalidInputError, match="allows no reply here"):
        mini(prompt="Hi.", structured_outputs={"grammar": "root ::= root"})


def test_the_demo_s_chat_keeps_the_structure_every_turn(capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Again?\n\n"))
    argv = [
        "demo",
        "--pair",
        "testbed-mini",
        "--choice",
        "a circle,a square",
        "--max-new-tokens",
        "8",
        "--chat",
    ]
    assert cli_main(argv) == 0
    replies = re.findall(r"^vlmspec> (.*)$", capsys.readouterr().out, re.M)
    assert len(replies) == 2 and all(r.strip() in ("a circle", "a square") for r in replies), replies


def test_xgrammar_s_own_processor_given_to_pipe_generate_is_refused_pointing_to_structured_outputs(mini):
    inputs = mini.prepare_inputs(None, "Hi.")
    processor = xgrammar.contrib.hf.LogitsProcessor(grammar_of(mini, {"choice": ["a"]}).compiled)
    with pytest.raises(InvalidInputError, match=r"xgrammar's processor.*structured_outputs="):
        mini.generate(**inputs, max_new_tokens=4, logits_processor=[processor])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_draft_s_masks_walked_by_path_are_the_tree_walk_s(mini_grammar, data):
    """Any tree of tokens (valid, rejected, past EOS) over any emitted prefix: the masks of the nodes asked for,
    each walked along its path, equal the rows of the one depth-first walk the verification uses."""
    grammar, vocab = mini_grammar
    guide = grammar.start()
    prefix = data.draw(st.lists(st.sampled_from(vocab), max_size=4))
    if not all(guide.matcher.accept_token(token) for token in prefix) or guide.matcher.is_terminated():
        return
    n = data.draw(st.integers(1, 24))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = torch.tensor([0] + [data.draw(st.sampled_from(vocab)) for _ in range(1, n)])
    nodes = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6, unique=True)))
    walked = guide.allowed(tokens, torch.tensor(parents), nodes)
    whole = guide._tree_bitmask(tokens, torch.tensor(parents))
    from vlmspec.structured import _unpack

    assert torch.equal(walked, _unpack(whole, grammar.width)[nodes])


@pytest.fixture(scope="module")
def mini_grammar(mini):
    """A JSON schema's grammar, and tokens that make its trees: its own pieces, words, EOS and others."""
    grammar = grammar_of(mini, STRUCTURES["json"])
    pieces = ['{"', "shapes", '":', " 1", " 2", ",", ' "', "caption", ' "a', " red", '"}', "}", "x"]
    vocab = sorted({t for p in pieces for t in mini.tokenizer.encode(p, add_special_tokens=False)})
    return grammar, vocab + list(mini.target.generation_config.eos_token_id)
