"""Lossless tree sampling: the emitted token follows the target's warped distribution, whatever the tree.

Statistical tests use Pearson's chi-square goodness of fit at significance level 0.001 (the test fails with
probability 0.1% when the implementation is right), over 20,000 draws each.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from vlmspec import VLMSpecPipeline
from vlmspec.models import adapter_for
from vlmspec.sampling import SamplingParams, draw
from vlmspec.testing import make_image
from vlmspec.tree import TokenTree
from vlmspec.verify import sample_accept

ALPHA = 1e-3
DRAWS = 20_000
SETTINGS = [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0),
    SamplingParams(temperature=0.7, top_k=20, top_p=1.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.9),
]


def sequential_accept(tree: TokenTree, probs: torch.Tensor, gen: torch.Generator, renormalise: bool = True):
    """The multi-candidate rejection rule written out node by node (reference and planted-bug variant).

    At each node the children are tried in order; a child is accepted with probability p'(child) (ratio to 1:
    children are picked deterministically); on rejection its mass is removed from the residual p' and p' is
    renormalised. With ``renormalise=False`` (the planted bug) the rejected mass is neither removed nor
    renormalised away, and the final token is drawn from the untouched distribution.
    """
    node, emitted = 0, []
    while True:
        residual = probs[node].clone()
        children = (tree.parents == node).nonzero().flatten().tolist()
        moved = False
        for child in children:
            token = int(tree.tokens[child])
            if torch.rand((), generator=gen) < residual[token]:
                emitted.append(token)
                node, moved = child, True
                break
            if renormalise:
                residual[token] = 0
                residual = residual / residual.sum()
        if not moved:
            final = residual if renormalise else probs[node]
            emitted.append(int(torch.multinomial(final, 1, generator=gen)))
            return emitted


def _branching_tree(probs: torch.Tensor) -> TokenTree:
    """Root with the 4 most likely tokens as children (deterministic picks), each with 2 children."""
    top = probs[0].topk(4).indices.tolist()
    tokens, parents = [0], [-1]
    for t in top:
        tokens.append(t)
        parents.append(0)
    for i in range(1, 5):
        for t in probs[i].topk(2).indices.tolist():
            tokens.append(t)
            parents.append(i)
    n = len(tokens)
    return TokenTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(n))


def _first_token_counts(rule, tree, probs, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(probs.shape[1])
    for _ in range(DRAWS):
        counts[rule(tree, probs, gen)[0]] += 1
    return counts


def _p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square p-value; tokens expected fewer than 5 times share one bin (the test's validity condition)."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token the warped distribution excludes"
    counts = counts.double()
    expected = expected_probs.double() / expected_probs.double().sum() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(dim=0, keepdim=True)])
    wanted = torch.cat([expected[big], expected[~big].sum(dim=0, keepdim=True)])
    if float(wanted[-1]) < 5:  # fold a tiny remainder bin into the smallest regular bin
        observed, wanted = observed[:-1], wanted[:-1]
        observed[-1] += counts[~big].sum()
        wanted[-1] += expected[~big].sum()
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


@pytest.fixture(scope="module")
def real_logits(tiny_pairs):
    """Target logits of a tiny Qwen2-VL at the nodes of a branching tree after a real image prompt."""
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    adapter = adapter_for(pipe.target)
    inputs = pipe.prepare_inputs(make_image(0), "Describe this image.")
    prefill = adapter.prefill(inputs)
    # Flatten the distribution a little so many tokens carry mass (a harder test than a peaked one).
    root_logits = prefill.logits[None] / 3
    probs0 = torch.softmax(root_logits, -1)
    stub = _branching_tree(torch.cat([probs0] * 5))
    state = prefill.state
    logits = adapter.forward(
        state,
        stub.tokens,
        stub.positions(inputs["input_ids"].shape[1]),
        stub.attention_bias(state.length, torch.float32),
    )
    return logits / 3


def _vectorised(tree, probs, gen):
    acc = sample_accept(tree, probs, gen)
    return torch.cat([tree.tokens[acc.path[1:]], acc.next_token.reshape(1)]).tolist()


@pytest.mark.parametrize(
    ("params", "rule"),
    [(params, "vectorised") for params in SETTINGS] + [(SETTINGS[0], "sequential")],
    ids=lambda p: p if isinstance(p, str) else f"T{p.temperature}-k{p.top_k}-p{p.top_p}",
)
def test_first_token_follows_warped_target_distribution(real_logits, params, rule):
    """The library's rule under every warping; the test's own node-by-node reference (``sequential_accept``, which
    the planted-bug test breaks) under one, enough to show the reference right: warping happens before either rule."""
    probs = params.probs(real_logits)  # [N+1, V] warped exactly like generate()
    tree = _branching_tree(probs)
    fn = _vectorised if rule == "vectorised" else sequential_accept
    counts = _first_token_counts(fn, tree, probs, seed=1)
    assert _p_value(counts, probs[0]) > ALPHA


def test_draw_follows_the_distribution_and_never_gives_a_token_without_mass(real_logits):
    """``draw`` (inverse transform sampling, the engine's one way to sample): rows drawn at once and many draws from
    one unnormalised distribution both follow it, and tokens outside top-k (no mass) never come up."""
    probs = SETTINGS[3].probs(real_logits)[0]  # [V], top-k 8 then top-p 0.9: most tokens have no mass
    gen = torch.Generator().manual_seed(3)
    rows = probs.expand(DRAWS // 10, -1)  # one draw from each of these equal rows, ten times
    by_rows = torch.cat([draw(rows, gen).squeeze(1) for _ in range(10)])  # [DRAWS]
    by_count = draw(3.0 * probs, gen, DRAWS)  # [DRAWS] draws from one row, not normalised
    for tokens in (by_rows, by_count):
        assert tokens.shape == (DRAWS,)
        assert _p_value(torch.bincount(tokens, minlength=probs.shape[0]), probs) > ALPHA
    skewed = torch.bincount(by_count, minlength=probs.shape[0]).float()
    skewed[probs.argmax()] *= 1.1  # the same test rejects a distribution 10% off on its likeliest token
    assert _p_value(skewed, probs) < ALPHA
    with pytest.raises(ValueError, match="without mass"):
        draw(torch.zeros(2, 5), gen)


def test_planted_bug_without_residual_renormalisation_fails(real_logits):
    probs = SETTINGS[0].probs(real_logits)
    tree = _branching_tree(probs)

    def buggy(t, p, g):
        return sequential_accept(t, p, g, renormalise=False)

    counts = _first_token_counts(buggy, tree, probs, seed=1)
    assert _p_value(counts, probs[0]) < ALPHA  # the same test, at the same level, rejects it


def test_same_seed_same_output_and_warping_matches_generate(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    kw = dict(max_new_tokens=24, do_sample=True, temperature=0.9, top_k=20, top_p=0.95)
    a = pipe(make_image(0), "Describe this image.", seed=7, **kw)
    b = pipe(make_image(0), "Describe this image.", seed=7, **kw)
    c = pipe(make_image(0), "Describe this image.", seed=8, **kw)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids
    assert a.stats.lossless and a.stats.steps > 0


def test_top_k_comes_before_top_p_as_in_generate():
    """generate() applies top-k, then top-p: with top_k=2 the nucleus of 0.6 is taken over the two kept tokens
    (0.5/0.7 = 0.71 >= 0.6: only the first), not over the whole distribution (0.5 + 0.2 >= 0.6: two tokens)."""
    from vlmspec.sampling import SamplingParams

    logits = torch.tensor([[0.5, 0.2, 0.15, 0.15]]).log()
    probs = SamplingParams(top_k=2, top_p=0.6).probs(logits)
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
