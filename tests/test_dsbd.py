"""``dsbd``: speculative beam sampling (shared/papers/dsbd.txt), memory mode.

Statistical tests use Pearson's chi-square goodness of fit at significance level ALPHA = 0.001 (a correct
implementation fails a test with probability 0.1%); each uses a fixed seed, so a run is repeatable. Candidates
expected fewer than 5 times share one bin; a candidate outside the target's support is an immediate failure.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from synthetic import SyntheticDraft, _CountingCache
from vlmspec_eval.dsbd_baseline import beam_sampling_baseline, perplexity

import vlmspec.verify as verify
from vlmspec import InvalidInputError, VLMSpecPipeline
from vlmspec.draft import DraftTree
from vlmspec.models import DecodeState, adapter_for
from vlmspec.policies import DSBDConfig, DSBDPolicy, get_policy
from vlmspec.sampling import Sampler, SamplingParams
from vlmspec.testing import make_image
from vlmspec.tree import TokenTree
from vlmspec.verify import (
    accepted_count_probs,
    beam_acceptance_probs,
    beam_distribution,
    dynamic_width,
    verify_beam_layer,
)

ROOT = Path(__file__).resolve().parents[1]
ALPHA = 1e-3

# ---- one verification layer (Theorem 3.1) ------------------------------------------------------------------------
# Two input beams, V = 6: candidates (beam, token) -> beam * 6 + token. Handmade target/draft next-token tables and
# beam probabilities; the draft is far from the target (many rejections, residual draws) and the target has a
# zero (token 5 after beam 0) that a wrong rule can hit.
V = 6
P_NEXT = torch.tensor(
    [[0.40, 0.25, 0.15, 0.10, 0.10, 0.00], [0.05, 0.05, 0.10, 0.30, 0.20, 0.30]], dtype=torch.float64
)
Q_NEXT = torch.tensor(
    [[0.10, 0.10, 0.30, 0.30, 0.10, 0.10], [0.30, 0.20, 0.20, 0.10, 0.10, 0.10]], dtype=torch.float64
)
P_BEAM = beam_distribution(torch.tensor([0.7, 0.3]), P_NEXT)  # [12]
Q_BEAM = beam_distribution(torch.tensor([0.4, 0.6]), Q_NEXT)
DRAFT_BEAMS, WIDTH, TRIALS = 4, 2, 20_000


def _p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``expected_probs``; 0 when a zero-probability cell was hit."""
    counts, expected_probs = counts.double().flatten(), expected_probs.double().flatten()
    support = expected_probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    counts, expected = counts[support], expected_probs[support] / expected_probs[support].sum() * counts.sum()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum(dim=0, keepdim=True)])
    wanted = torch.cat([expected[big], expected[~big].sum(dim=0, keepdim=True)])
    if float(wanted[-1]) < 5:  # fold a small remainder bin into the smallest regular bin
        observed, wanted = observed[:-1], wanted[:-1]
        observed[-1] += counts[~big].sum()
        wanted[-1] += expected[~big].sum()
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


def _layer_p_values(seed: int = 0) -> tuple[float, float, float]:
    """p-values of output beam 1, output beam 2 and the pair (independence) against p_beam, p_beam, p_beam x p_beam."""
    gen = torch.Generator().manual_seed(seed)
    first, second, pair = torch.zeros(2 * V), torch.zeros(2 * V), torch.zeros(2 * V, 2 * V)
    for _ in range(TRIALS):
        draws = torch.multinomial(Q_BEAM, DRAFT_BEAMS, replacement=True, generator=gen)  # i.i.d. q_beam
        out = verify_beam_layer(P_BEAM, Q_BEAM, draws, WIDTH, gen).outputs.tolist()
        first[out[0]] += 1
        second[out[1]] += 1
        pair[out[0], out[1]] += 1
    return (
        _p_value(first, P_BEAM),
        _p_value(second, P_BEAM),
        _p_value(pair, P_BEAM[:, None] * P_BEAM[None, :]),
    )


def test_one_layer_outputs_iid_p_beam():
    """Theorem 3.1: each output beam of a layer is p_beam-distributed, and the output beams are independent."""
    p_first, p_second, p_pair = _layer_p_values()
    print(f"layer law p-values: first {p_first:.3g}, second {p_second:.3g}, pair {p_pair:.3g}")
    assert min(p_first, p_second, p_pair) > ALPHA


def _residual_not_renormalised(residual, q):
    return (residual - q).clamp_min(0.0)


def _line_16_literally(residual, q):
    return (q / residual).clamp(max=1.0)  # Algorithm 1 line 16 as printed: r <= q / p'


@pytest.mark.parametrize(
    ("name", "replacement"),
    [("_beam_residual", _residual_not_renormalised), ("_beam_accept_prob", _line_16_literally)],
    ids=["residual-not-renormalised", "ratio-q-over-p"],
)
def test_planted_bugs_fail_the_same_test(monkeypatch, name, replacement):
    monkeypatch.setattr(verify, name, replacement)
    p_first, p_second, p_pair = _layer_p_values()
    print(f"{name} bug p-values: first {p_first:.3g}, second {p_second:.3g}, pair {p_pair:.3g}")
    assert min(p_first, p_second, p_pair) < ALPHA


# ---- dynamic width (Eq. 2-7) -------------------------------------------------------------------------------------
def _brute_force_counts(alphas: list[float]) -> list[float]:
    """P(exactly k accepted) by enumerating accept/reject patterns; the alphas restart after each acceptance."""
    m = len(alphas)
    out = [0.0] * (m + 1)
    for pattern in itertools.product([True, False], repeat=m):
        prob, since = 1.0, 0
        for accepted in pattern:
            a = alphas[since]
            prob *= a if accepted else 1.0 - a
            since = 0 if accepted else since + 1
        out[sum(pattern)] += prob
    return out


@pytest.mark.parametrize(
    "alphas", [[0.9, 0.6, 0.3, 0.2], [0.5, 0.5], [0.2], [1.0, 0.0, 0.7], [0.3, 0.9, 0.95, 0.1, 0.6]]
)
def test_accepted_count_probs_match_enumeration(alphas):
    got = accepted_count_probs(alphas)
    assert torch.allclose(got, torch.tensor(_brute_force_counts(alphas), dtype=torch.float64), atol=1e-12)
    assert math.isclose(float(got.sum()), 1.0, abs_tol=1e-12)


def test_dynamic_width_on_handmade_alphas():
    alphas = [0.9, 0.6, 0.3, 0.2]
    counts = _brute_force_counts(alphas)
    at_least = [1 - sum(counts[:k]) for k in range(len(alphas) + 1)]  # P(at least k accepted)
    assert at_least[1] == pytest.approx(1 - 0.1 * 0.4 * 0.7 * 0.8)
    for t in (0.05, 0.3, 0.5, 0.7, 0.9, 0.95):
        want = max(k for k in range(len(alphas) + 1) if at_least[k] >= t)
        assert dynamic_width(alphas, t, 1) == max(1, want)
    # Eq. 6's floor: below W_min the width is W_min.
    assert dynamic_width([0.1, 0.1, 0.1, 0.1], 0.9, 1) == 1
    assert dynamic_width([0.1, 0.1, 0.1, 0.1], 0.9, 3) == 3


def test_dynamic_width_edge_cases():
    draft_beams = 5
    # t = 1: only a certain acceptance counts, so an uncertain layer gets W_min.
    assert dynamic_width([0.99] * draft_beams, 1.0, 1) == 1
    assert dynamic_width([0.99] * draft_beams, 1.0, 2) == 2
    # Every draft beam surely accepted (draft == target): the width is W_S, whatever t.
    for t in (0.0, 0.5, 0.9, 1.0):
        assert dynamic_width([1.0] * draft_beams, t, 1) == draft_beams
    # t = 0: every draft beam is wanted.
    assert dynamic_width([0.01] * draft_beams, 0.0, 1) == draft_beams
    # No draft beam left at the layer (all parents rejected): W_min.
    assert dynamic_width([], 0.5, 1) == 1


def test_acceptance_probs_eq_4():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.0, 0.5, 0.5])
    # alpha_1 = sum min(p, q) = 0.5; residual norm(max(p - q, 0)) = [1, 0, 0]; alpha_2 = 0.
    assert beam_acceptance_probs(p, q, 3).tolist() == pytest.approx([0.5, 0.0, 0.0])
    assert beam_acceptance_probs(P_BEAM, P_BEAM, 4).tolist() == pytest.approx([1.0] * 4)
    assert beam_acceptance_probs(P_BEAM, Q_BEAM, 0).numel() == 0


# ---- the policy on a synthetic Markov pair (no model) -----------------------------------------------------------
TABLE_T = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.12, 0.08, 0.05],
        [0.05, 0.40, 0.22, 0.18, 0.10, 0.05],
        [0.20, 0.05, 0.35, 0.25, 0.10, 0.05],
        [0.10, 0.15, 0.05, 0.45, 0.15, 0.10],
        [0.33, 0.07, 0.12, 0.08, 0.31, 0.09],
        [0.14, 0.19, 0.23, 0.06, 0.11, 0.27],
    ]
)
TABLE_D = TABLE_T.roll(1, dims=1) * 0.5 + 1.0 / 12  # a different (worse) draft


def _markov(table):
    return lambda tokens, positions: table[tokens]


def _target_logits(tokens: torch.Tensor, table=TABLE_T) -> torch.Tensor:
    return table[tokens].clamp_min(1e-12).log()


def _draft_tree(root: int, table) -> DraftTree:
    state = DecodeState(cache=_CountingCache(), rope_delta=torch.zeros((), dtype=torch.long), visual_tokens=0)
    empty = torch.zeros(0, dtype=torch.long)
    return DraftTree(SyntheticDraft(_markov(table)), state, torch.tensor(root), 10, empty, depth_limit=16)


def _primed(policy: DSBDPolicy, sampler: Sampler, root: int) -> DSBDPolicy:
    """The engine hands the sampler to the policy at its first accept (a root-only step)."""
    policy.reset()
    policy.accept(TokenTree.root_only(torch.tensor(root)), _target_logits(torch.tensor([root])), sampler)
    return policy


WARP = SamplingParams(temperature=1.0, top_k=4, top_p=1.0)  # top-4 of 6: the warping matters


def test_policy_with_width_one_samples_the_target_sequence_law():
    """t = 1 gives W_L = W_min = 1 at every layer: DSBD is then multinomial sampling of the target (warped)."""
    policy = get_policy("dsbd", gamma=2, draft_width=3, threshold=1.0, w_min=1, top_k=None, top_p=None)
    sampler = Sampler(WARP, torch.Generator().manual_seed(3))
    root, trials = 2, 2500
    _primed(policy, sampler, root)
    counts = torch.zeros(V, V)
    widths = set()
    for _ in range(trials):
        emitted, node = [], root
        while len(emitted) < 2:  # continue with the next step as the engine does
            tree = policy.build_tree(_draft_tree(node, TABLE_D))
            acc = policy.accept(tree, _target_logits(tree.tokens), sampler)
            emitted += tree.tokens[acc.path[1:]].tolist() + [int(acc.next_token)]
            widths.update(policy.trace()["widths"])
            node = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    warped = WARP.probs(TABLE_T.log())  # [V, V] p~(next | token)
    law = warped[root][:, None] * warped  # p~(x1 | root) p~(x2 | x1)
    p = _p_value(counts, law)
    print(f"width-1 sequence law p-value {p:.3g}")
    assert widths == {1} and p > ALPHA


def test_policy_memory_mode_keeps_the_likeliest_of_iid_beams():
    """Draft == target, t = 0: both layer-1 draft beams pass (W = W_S = 2), two beams of layer 2 are sampled from
    p_beam over them, and the one with the highest raw target likelihood is emitted: compared with the exact law."""
    policy = get_policy("dsbd", gamma=1, draft_width=2, threshold=0.0, w_min=1, top_k=None, top_p=None)
    sampler = Sampler(WARP, torch.Generator().manual_seed(4))
    root, trials = 1, 3000
    _primed(policy, sampler, root)
    counts = torch.zeros(V, V)
    for _ in range(trials):
        tree = policy.build_tree(_draft_tree(root, TABLE_T))
        acc = policy.accept(tree, _target_logits(tree.tokens), sampler)
        assert policy.trace()["widths"] == [2, 2] and acc.num_accepted == 1
        counts[int(tree.tokens[acc.path[1]]), int(acc.next_token)] += 1
    # Exact law: a1, a2 ~ p~(. | root) i.i.d.; two draws (i, x) ~ p~(a_i) p~(x | a_i) / (p~(a1) + p~(a2)); keep the
    # draw with the largest raw log p(a_i | root) + log p(x | a_i) (the first on ties).
    warped = WARP.probs(TABLE_T.log()).double()
    raw = TABLE_T.double().log()
    law = torch.zeros(V, V, dtype=torch.float64)
    for a in itertools.product(range(V), repeat=2):
        pa = warped[root, a[0]] * warped[root, a[1]]
        if pa == 0:
            continue
        beam = beam_distribution(warped[root, list(a)], warped[list(a)]).view(2, V)
        cands = [(i, x) for i in range(2) for x in range(V) if beam[i, x] > 0]
        for (i, x), (j, y) in itertools.product(cands, repeat=2):
            first, second = raw[root, a[i]] + raw[a[i], x], raw[root, a[j]] + raw[a[j], y]
            win = (a[i], x) if first >= second else (a[j], y)
            law[win] += pa * beam[i, x] * beam[j, y]
    assert math.isclose(float(law.sum()), 1.0, abs_tol=1e-6)
    p = _p_value(counts, law)
    print(f"memory-mode selection p-value {p:.3g}")
    assert p > ALPHA


# ---- config ------------------------------------------------------------------------------------------------------
def test_yaml_holds_the_defaults():
    assert DSBDConfig.from_yaml(ROOT / "configs" / "policies" / "dsbd.yaml") == DSBDConfig()
    c = DSBDConfig()
    assert (c.top_k, c.top_p, c.w_min, c.gamma, c.draft_width, c.threshold) == (10, 0.8, 1, 3, 4, 0.9)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("gamma", 0),
        ("draft_width", 0),
        ("threshold", 1.5),
        ("w_min", 0),
        ("w_min", 5),
        ("top_k", -1),
        ("top_p", 0.0),
    ],
)
def test_bad_config_values_are_named(option, value):
    with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
        get_policy("dsbd", **{option: value})


def test_forest_mode_is_rejected_with_the_reason():
    with pytest.raises(ValueError, match=r"memory_mode=False.*one target KV cache.*not supported"):
        get_policy("dsbd", memory_mode=False)


# ---- end to end on a tiny Qwen2-VL pair -----------------------------------------------------------------------------
SAMPLE = dict(do_sample=True, temperature=1.0, top_k=10, top_p=0.8, max_new_tokens=16)


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="dsbd", torch_dtype=torch.float32)


def test_end_to_end_runs_and_repeats(pipe):
    a = pipe(make_image(0), "Describe this image.", seed=5, **SAMPLE)
    b = pipe(make_image(0), "Describe this image.", seed=5, **SAMPLE)
    assert a.token_ids == b.token_ids and len(a.token_ids) >= 1
    assert a.stats.lossless is False and a.stats.policy == "dsbd"
    assert a.stats.trace[0]["gamma"] > 0  # drafting from the first step on (the sampler arrives before it)
    with pytest.raises(InvalidInputError, match="no greedy form"):  # refused before any forward
        pipe.policy.begin(None)
    # Wide layers (t = 0): runs, and every step emits as many tokens as layers it verified.
    pipe.policy = get_policy("dsbd", threshold=0.0, draft_width=3)
    try:
        c = pipe(make_image(0), "Describe this image.", seed=5, **SAMPLE)
    finally:
        pipe.policy = get_policy("dsbd")
    assert len(c.token_ids) == 16 or c.token_ids[-1] in pipe.target.generation_config.eos_token_id
    assert all(step["accepted"] == step["layers"] - 1 for step in c.stats.trace)
    assert max(max(step["widths"]) for step in c.stats.trace) > 1


def test_greedy_and_mismatched_warping_raise_clear_errors(pipe):
    with pytest.raises(ValueError, match=r"do_sample=True"):
        pipe(make_image(0), "Describe this image.", max_new_tokens=4)
    with pytest.raises(ValueError, match=r"top_k=10, top_p=0.8.*top_k=3"):
        pipe(make_image(0), "Describe this image.", **{**SAMPLE, "top_k": 3, "max_new_tokens": 4})


def test_baseline_and_perplexity(pipe):
    image, prompt = make_image(0), "Describe this image."
    base = beam_sampling_baseline(pipe, image, prompt, width=2, max_new_tokens=6, seed=0)
    again = beam_sampling_baseline(pipe, image, prompt, width=2, max_new_tokens=6, seed=0)
    assert base.token_ids == again.token_ids and 1 <= len(base.token_ids) <= 6 and base.seconds > 0
    # perplexity (one full forward) equals the engine's own computation: prefill, then the tokens as a chain.
    inputs = pipe.prepare_inputs(image, prompt)
    tokens = base.token_ids
    adapter = adapter_for(pipe.target)
    prefill = adapter.prefill(inputs)
    all_logits = [prefill.logits[None]]
    if len(tokens) > 1:
        n = len(tokens) - 1
        chain = TokenTree(torch.tensor(tokens[:-1]), torch.arange(-1, n - 1), torch.ones(n))
        positions = chain.positions(inputs["input_ids"].shape[1])
        bias = chain.attention_bias(prefill.state.length, torch.float32)
        all_logits.append(adapter.forward(prefill.state, chain.tokens, positions, bias))
    all_logits = torch.cat(all_logits).double()
    nll = -torch.log_softmax(all_logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)].mean()
    assert perplexity(pipe, inputs, tokens) == pytest.approx(math.exp(float(nll)), rel=1e-4)
