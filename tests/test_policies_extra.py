"""The alternative tree policies: EAGLE-2, WETAP, C2T, PCT.

Formulas on synthetic draft distributions driving the real DraftTree (as test_sage.py does), the WETAP
Appendix-D pruning example worked by hand, WETAP's beam acceptance on a hand-made tree, config validation and
YAML defaults, C2T tooling end to end, and the lossless matrix (greedy output == ``target.generate``) for every
family and input kind.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from conftest import PROMPTS, input_kinds
from safetensors.torch import load_file
from synthetic import geometric, peaked, synthetic_tree, table

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.c2t_tools import Example, collect, train
from vlmspec.c2t_tools import main as c2t_main
from vlmspec.costs import ForwardCosts
from vlmspec.policies import (
    C2TClassifier,
    C2TConfig,
    C2TPolicy,
    EAGLE2Config,
    EAGLE2Policy,
    PCTConfig,
    PCTPolicy,
    SAGEConfig,
    SAGEPolicy,
    WETAPConfig,
    WETAPPolicy,
    distribution_entropy,
    wetap_prune,
)
from vlmspec.policies.c2t import DEFAULT_CLASSIFIER, candidate_features, spec_path
from vlmspec.policies.wetap import normalized_entropy
from vlmspec.probe import measure_cost_ratio
from vlmspec.testing import FAMILIES
from vlmspec.tree import TokenTree
from vlmspec.verify import beam_accept, greedy_accept

ROOT = Path(__file__).resolve().parents[1]


def _recording(draft):
    """Wrap ``draft.next_probs`` to record which nodes were expanded."""
    expanded: list[int] = []
    original = draft.next_probs

    def next_probs(nodes):
        expanded.extend(nodes.tolist())
        return original(nodes)

    draft.next_probs = next_probs
    return expanded


def _closed(tree: TokenTree, draft) -> bool:
    """Every kept node's whole ancestry is kept: its depth in the verified tree is its depth in the draft."""
    return torch.equal(tree.depths, draft.depths[tree.source_ids]) and bool((tree.parents[1:] >= 0).all())


# ---- EAGLE-2 ---------------------------------------------------------------------------------------------------
def test_eagle2_expands_top_k_per_level_and_reranks_to_a_closed_subtree():
    policy = EAGLE2Policy()
    assert (policy.config.depth, policy.config.top_k, policy.config.total_tokens) == (6, 10, 60)
    draft, adapter = synthetic_tree(geometric(64, 0.7))
    tree = policy.build_tree(draft)
    # Root forward, then the top-10 nodes of each of levels 1..5 in one forward each; 10 + 5 * 100 candidates.
    assert adapter.calls == [1, 10, 10, 10, 10, 10]
    assert policy.trace()["candidates"] == draft.num_nodes == 10 + 5 * 100
    assert tree.num_nodes == 60 and tree.max_depth <= 6
    kept = tree.source_ids
    assert bool((draft.parents[kept[1:]] >= 0).all())
    assert set(draft.parents[kept[1:]].tolist()) <= set(kept.tolist())  # ancestor-closed
    dropped = torch.ones(draft.num_nodes + 1, dtype=torch.bool)
    dropped[kept] = False
    assert float(draft.cum_probs[kept[1:]].min()) >= float(
        draft.cum_probs[dropped].max()
    )  # the top 60 by cum


@pytest.mark.parametrize("dist", [peaked(32, 1.0), lambda t, p: torch.full((t.shape[0], 32), 1 / 32)])
def test_eagle2_rerank_is_closed_under_ties(dist):
    # One-hot drafts give children with exactly their parent's cumulative probability; uniform ones give ties
    # between siblings and cousins everywhere. The rerank must still keep every kept node's parent.
    for total in (1, 7, 23, 60):
        draft, _ = synthetic_tree(dist)
        tree = EAGLE2Policy(EAGLE2Config(depth=4, top_k=5, total_tokens=total)).build_tree(draft)
        assert tree.num_nodes == total
        kept = set(tree.source_ids.tolist())
        assert all(int(draft.parents[i]) in kept for i in kept if i)


# ---- WETAP -----------------------------------------------------------------------------------------------------
def test_wetap_width_from_normalised_entropy():
    c = WETAPConfig()
    assert (c.budget, c.length, c.w_min, c.w_max, c.gamma, c.alpha, c.top_k, c.top_p) == (
        64,
        8,
        16,
        128,
        1.2,
        0.6,
        10,
        0.9,
    )
    # H_norm = 0 (all mass on one beam, or a single beam) -> W_min; H_norm = 1 (even beams) -> W_max.
    assert normalized_entropy(torch.tensor([0.7])) == 0.0
    assert normalized_entropy(torch.tensor([0.5, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-9)
    assert c.next_width(0.0) == 16
    assert normalized_entropy(torch.tensor([0.01] * 7)) == pytest.approx(1.0)
    assert c.next_width(1.0) == 128
    # Eq. 3-6 by hand: PI-normalise (scale does not matter), entropy, divide by log W_t; gamma 1.2.
    probs = torch.tensor([0.3, 0.1, 0.05, 0.05], dtype=torch.float64)
    p = probs / probs.sum()
    h_norm = float(-(p * p.log()).sum()) / math.log(4)
    assert normalized_entropy(probs) == pytest.approx(h_norm, rel=1e-9)
    assert c.next_width(h_norm) == math.floor(16 + 112 * h_norm**1.2 + 0.5)
    assert c.next_width(h_norm) == 100  # H_norm .7855 -> 16 + 112 * .7485 = 99.8 -> 100
    assert c.next_width(0.5) == 65  # 16 + 112 * 0.5 ** 1.2 = 64.75 -> 65
    assert WETAPConfig(gamma=0.5).next_width(0.5) == 95  # 16 + 112 * 0.7071 = 95.2


def test_wetap_layer_widths_on_a_synthetic_draft():
    # A one-hot draft: every layer is a single beam (H_norm 0), so every layer after the first has W_min slots,
    # but each parent only offers its one top-P token: the tree is a chain of length L.
    policy = WETAPPolicy()
    draft, adapter = synthetic_tree(peaked(64, 1.0))
    tree = policy.build_tree(draft)
    assert policy.trace()["widths"] == [1] * 8 and tree.max_depth == 8
    # An even draft over 8 tokens (top-P 0.9 keeps all 8): layer 1 has 8 even beams (H_norm 1), so W_2 = 128 and
    # all 64 grandchildren are kept, then 128 of their 512 children; the 200 nodes are pruned to the budget.
    even = lambda t, p: torch.cat([torch.full((t.shape[0], 8), 0.125), torch.zeros(t.shape[0], 56)], dim=1)  # noqa: E731
    draft, adapter = synthetic_tree(even)
    policy = WETAPPolicy(WETAPConfig(length=3))
    tree = policy.build_tree(draft)
    assert policy.trace() == {"widths": [8, 64, 128], "candidates": 200}
    assert adapter.calls == [1, 8, 64]  # one batched forward per layer; the last layer is not expanded
    assert tree.num_nodes == 64 and _closed(tree, draft)


# The Appendix D example (figure not in the text), rebuilt with its stated setup: L = 4, W in [3, 6],
# budget 12, layer widths 3, 5, 4, 4 (16 tokens), alpha 0.6, gamma 1.2. Node -> (parent, draft probability).
APPENDIX_D = {
    1: (0, 0.78), 2: (0, 0.10), 3: (0, 0.09),
    4: (1, 0.625), 5: (2, 0.6), 6: (3, 0.05 / 0.09), 7: (1, 0.0375), 8: (1, 0.025),
    9: (4, 0.8), 10: (5, 0.04 / 0.06), 11: (7, 0.02 / 0.03), 12: (6, 0.6),
    13: (9, 0.75), 14: (10, 0.75), 15: (11, 0.5), 16: (9, 0.0125),
}  # fmt: skip
# Cumulative probabilities: 1 .78 | 2 .10 | 3 .09 | 4 .4875 | 5 .06 | 6 .05 | 7 .02925 | 8 .0195 | 9 .39 |
# 10 .04 | 11 .0195 | 12 .03 | 13 .2925 | 14 .03 | 15 .00975 | 16 .004875.
# Widths (Eq. 3-6): layer 1 (.78, .10, .09): H_norm .614 -> 3 + 3 * .557 = 4.67 -> 5; layer 2: H_norm .534
# -> 3 + 3 * .471 = 4.41 -> 4; layer 3: H_norm .457 -> 3 + 3 * .391 = 4.17 -> 4.
# Scores (Eq. 7-8, p_min .004875, p_max .78): 3 .1659 < 2 .1736 < 8 .2113 < 7 .2189 < 6 .2349 < 5 .2427 < ...
# so budget pruning drops 2, 3, 7, 8 and keeps 5, 6, 11 whose parents 2, 3, 7 are missing; re-adding them gives
# 15 tokens. Leaf pass: 12 is the only leaf above the deepest layer -> 14 tokens. Lowest-probability leaves:
# 16 (.004875), then 15 (.00975) -> 12 tokens (6, now a leaf at .05, stays).
APPENDIX_D_KEPT = [1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 14]


def _appendix_d_draft():
    vocab, noise = 1000, torch.arange(200, 1000)
    rows: dict[int, torch.Tensor] = {}
    for node, (parent, prob) in APPENDIX_D.items():
        key = 1 if parent == 0 else 100 + parent  # synthetic_tree's root token is 1; node i is token 100 + i
        rows.setdefault(key, torch.zeros(vocab))[100 + node] = prob
    for row in rows.values():  # the remaining mass is spread thinly over 800 other tokens
        row[noise] = (1 - row.sum()) / noise.numel()

    def dist(tokens, positions):
        flat = torch.zeros(vocab)
        flat[noise] = 1 / noise.numel()
        return torch.stack([rows.get(int(t), flat) for t in tokens])

    return synthetic_tree(dist)


def test_wetap_appendix_d_pruning_example():
    draft, adapter = _appendix_d_draft()
    policy = WETAPPolicy(WETAPConfig(budget=12, length=4, w_min=3, w_max=6))
    tree = policy.build_tree(draft)
    assert policy.trace() == {"widths": [3, 5, 4, 4], "candidates": 16}
    assert adapter.calls == [1, 3, 5, 4]
    assert sorted(int(t) - 100 for t in tree.tokens[1:]) == APPENDIX_D_KEPT
    # The same on the pure function, with the tree numbered as in the example.
    parents = torch.tensor([-1] + [APPENDIX_D[i][0] for i in range(1, 17)])
    cum = torch.ones(17, dtype=torch.float64)
    depths = torch.zeros(17, dtype=torch.long)
    for i in range(1, 17):
        cum[i] = cum[parents[i]] * APPENDIX_D[i][1]
        depths[i] = depths[parents[i]] + 1
    assert wetap_prune(parents, depths, cum, 12, 0.6, 4).tolist() == [0, *APPENDIX_D_KEPT]
    assert wetap_prune(parents, depths, cum, 16, 0.6, 4).tolist() == list(
        range(17)
    )  # within budget: untouched


def test_wetap_ancestor_repair_then_leaf_pass():
    # 1 (d1 .3) -> 2 (d2 .28); 3 (d1 .6) -> 4 (d2 .1). L = 2, alpha 0.6, p in [.1, .6]:
    # scores 1 .44, 2 .616, 3 .8, 4 .4.
    parents, depths = torch.tensor([-1, 0, 1, 0, 3]), torch.tensor([0, 1, 2, 1, 2])
    cum = torch.tensor([1.0, 0.3, 0.28, 0.6, 0.1])
    assert wetap_prune(parents, depths, cum, 3, 0.6, 2).tolist() == [0, 1, 2, 3]  # top 3 is closed already
    # Budget 2: {3, 2} by score; 2's parent 1 is re-added (3 > 2); the leaf pass drops 3, a depth-1 leaf.
    assert wetap_prune(parents, depths, cum, 2, 0.6, 2).tolist() == [0, 1, 2]
    # Budget 1: {3}: closed. alpha 1 (probability only) never needs a repair.
    assert wetap_prune(parents, depths, cum, 1, 0.6, 2).tolist() == [0, 3]
    assert wetap_prune(parents, depths, cum, 2, 1.0, 2).tolist() == [0, 1, 3]


@pytest.mark.parametrize("budget", [1, 5, 20, 64])
def test_wetap_trees_are_closed_and_within_budget(budget):
    draft, _ = synthetic_tree(geometric(64, 0.8))
    tree = WETAPPolicy(WETAPConfig(budget=budget, length=5, w_min=4, w_max=24)).build_tree(draft)
    assert 0 < tree.num_nodes <= budget and _closed(tree, draft)


# ---- beam acceptance -------------------------------------------------------------------------------------------
def _beam_case():
    # root -> a (token 5, q .5), b (token 6, q .4); a -> c (token 7, q .5); b -> d (token 8, q .5).
    tree = TokenTree(
        tokens=torch.tensor([1, 5, 6, 7, 8]),
        parents=torch.tensor([-1, 0, 0, 1, 2]),
        draft_probs=torch.tensor([1.0, 0.5, 0.4, 0.5, 0.5]),
    )
    target = torch.full((5, 10), 1e-9)  # target probabilities; token 0 holds the rest of each row's mass
    target[0, 5], target[0, 6], target[0, 0] = 0.2, 0.6, 0.2  # at the root: argmax 6
    target[1, 7], target[1, 0] = 0.9, 0.1  # after a
    target[2, 8], target[2, 9], target[2, 0] = 0.3, 0.5, 0.2  # after b: argmax 9
    target[3, 1], target[3, 0] = 0.7, 0.3  # after c
    target[4, 2], target[4, 0] = 0.7, 0.3  # after d
    target = target / target.sum(dim=1, keepdim=True)
    return tree, target.log()


def test_beam_accept_on_a_hand_made_tree():
    tree, logits = _beam_case()
    # Cumulative ratios: a .2/.5 = .4; b .6/.4 = 1.5; c .4 * .9/.5 = .72; d 1.5 * .3/.5 = .9.
    assert greedy_accept(tree, logits).path.tolist() == [0, 2]  # lossless rule: b, then d is not the argmax
    acc = beam_accept(tree, logits, tau=0.5)  # depth 2: c and d pass; c has the higher draft cum (.25 > .2)
    assert acc.path.tolist() == [0, 1, 3] and int(acc.next_token) == 1
    acc = beam_accept(tree, logits, tau=0.8)  # only d passes at depth 2
    assert acc.path.tolist() == [0, 2, 4] and int(acc.next_token) == 2
    acc = beam_accept(tree, logits, tau=1.0)  # nothing at depth 2; depth 1: b (1.5)
    assert acc.path.tolist() == [0, 2] and int(acc.next_token) == 9
    single = TokenTree(tokens=tree.tokens[:2], parents=tree.parents[:2], draft_probs=tree.draft_probs[:2])
    acc = beam_accept(single, logits[:2], tau=0.5)  # a: .4 < .5, nothing accepted: the root and its argmax
    assert acc.path.tolist() == [0] and int(acc.next_token) == 6


def test_wetap_beam_acceptance_is_opt_in_and_not_lossless():
    assert WETAPPolicy().lossless
    with pytest.warns(UserWarning, match="wetap_beam"):
        policy = get_policy("wetap", acceptance="wetap_beam", tau=0.8)
    assert not policy.lossless
    tree, logits = _beam_case()
    assert policy.accept(tree, logits).path.tolist() == [0, 2, 4]
    assert WETAPPolicy().accept(tree, logits).path.tolist() == [0, 2]

    class FixedSampler:  # when sampling, the token after the chosen beam is drawn at its node (t ~ p')
        def sample(self, node_logits):
            assert torch.equal(node_logits, logits[4])
            return torch.tensor(3)

    acc = policy.accept(tree, logits, FixedSampler())
    assert acc.path.tolist() == [0, 2, 4] and int(acc.next_token) == 3


# ---- C2T -------------------------------------------------------------------------------------------------------
def test_c2t_features():
    vocab = 1500  # more than 1000 tokens: the entropy covers only the top 1000, renormalised
    probs = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)) * 2, dim=-1)
    top = probs.topk(1000, dim=-1).values
    top = top / top.sum(dim=-1, keepdim=True)
    expected = -(top * top.log()).sum(dim=-1)
    assert torch.allclose(distribution_entropy(probs), expected, rtol=1e-5)
    assert not torch.allclose(distribution_entropy(probs), -(probs * probs.log()).sum(dim=-1), rtol=1e-3)
    uniform = torch.full((1, 64), 1 / 64)
    assert float(distribution_entropy(uniform)) == pytest.approx(math.log(64), rel=1e-6)
    feats = candidate_features(
        torch.tensor([0.5, 0.2]), torch.tensor([1.0, 2.0]), torch.tensor([[0.4, 0.1]] * 2), 3
    )
    assert feats.shape == (2, 2, 3)
    assert feats[0, 0].tolist() == pytest.approx([0.2, 1.0, 3.0]) and feats[1, 1].tolist() == pytest.approx(
        [0.02, 2.0, 3.0]
    )


class _JointConfidence(torch.nn.Module):
    """Stand-in classifier whose confidence is the joint probability itself."""

    def forward(self, features):
        return features[..., 0]


def _c2t(**options) -> C2TPolicy:
    policy = C2TPolicy(C2TConfig(**options))
    policy.classifier = _JointConfidence()
    return policy


def test_c2t_beta_threshold_and_second_top_k_pruning():
    # geometric(0.5): the draft's ranks have probabilities ~ .5, .25, .125, ...; confidence = joint probability.
    policy = _c2t(beta=0.1, top_k=2)
    draft, adapter = synthetic_tree(geometric(64, 0.5))
    tree = policy.build_tree(draft)
    # Layer 1: top-2 children .5, .25 pass. Layer 2: candidates .25, .125 (of .5) and .125, .0625 (of .25):
    # three pass beta, the second pruning keeps the 2 most confident. Layer 3: only .125 passes. Layer 4: none.
    assert policy.trace()["layers"] == [2, 2, 1]
    cum = draft.cum_probs[tree.source_ids[1:]]
    assert bool((cum > 0.1).all())
    level2 = draft.cum_probs[(draft.depths == 2).nonzero().flatten()]
    assert sorted(level2.tolist(), reverse=True) == pytest.approx([0.25, 0.125], rel=1e-3)
    assert adapter.calls == [1, 2, 2, 1]  # the last pass expands its node, whose children all fail
    # beta filters before the top-K: with beta 0.3 only .5 passes at layer 1 and .25 at layer 2.
    policy = _c2t(beta=0.3, top_k=15)
    draft, _ = synthetic_tree(geometric(64, 0.5))
    policy.build_tree(draft)
    assert policy.trace()["layers"] == [1]  # .25 is not > .3
    # Nothing passes: the root alone (a plain decoding step), one root forward.
    policy = _c2t(beta=0.9)
    draft, adapter = synthetic_tree(geometric(64, 0.5))
    assert policy.build_tree(draft).num_nodes == 0 and adapter.calls == [1]
    # Everything passes: max_depth and top_k bound the tree.
    policy = _c2t(beta=0.0, top_k=3, max_depth=4)
    draft, _ = synthetic_tree(geometric(64, 0.5))
    tree = policy.build_tree(draft)
    assert policy.trace()["layers"] == [3, 3, 3, 3] and tree.max_depth == 4


def test_c2t_default_classifier_loads_and_scores():
    assert DEFAULT_CLASSIFIER.is_file() and spec_path(DEFAULT_CLASSIFIER).is_file()
    classifier = C2TClassifier.load(DEFAULT_CLASSIFIER)
    assert classifier.fc1.out_features == 48 and classifier.spec["features"] == [
        "joint_prob",
        "entropy",
        "depth",
    ]
    assert {"recall", "positive_rate"} <= set(classifier.spec["metrics"])
    with torch.no_grad():
        confident = classifier(torch.tensor([[0.5, 1.0, 1.0]]))  # a likely shallow token
        doubtful = classifier(
            torch.tensor([[1e-6, 6.0, 11.0]])
        )  # an unlikely deep one from a flat distribution
    assert 0 < float(doubtful) < 0.5 < float(confident) <= 1
    policy = get_policy("c2t")
    draft, _ = synthetic_tree(peaked(64, 0.95))
    tree = policy.build_tree(draft)
    assert tree.num_nodes >= 1 and _closed(tree, draft)


# ---- PCT -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.02, 0.1, 0.3])
def test_pct_expands_a_node_iff_its_cumulative_confidence_reaches_the_cost_ratio(ratio):
    policy = PCTPolicy(PCTConfig(cost_ratio=ratio, leaf_threshold=0.0))
    assert (policy.config.width, policy.config.max_depth) == (5, 10)
    draft, _ = synthetic_tree(geometric(64, 0.6))
    expanded = _recording(draft)
    tree = policy.build_tree(draft)
    depth = policy.config.max_depth
    should = [
        i
        for i in range(draft.num_nodes + 1)
        if float(draft.cum_probs[i]) >= ratio and int(draft.depths[i]) < depth
    ]
    assert sorted(expanded) == should
    # Every expanded node has exactly `width` children; nothing was removed with threshold 0.
    children = torch.bincount(draft.parents[1:], minlength=draft.num_nodes + 1)
    assert all(int(children[i]) == 5 for i in expanded)
    assert tree.num_nodes == draft.num_nodes and policy.trace()["cost_ratio"] == ratio


def test_pct_removes_leaves_below_the_threshold():
    policy = PCTPolicy(PCTConfig(cost_ratio=0.005, max_depth=3))
    draft, _ = synthetic_tree(geometric(64, 0.6))
    tree = policy.build_tree(draft)
    cum = draft.cum_probs
    kept = set(tree.source_ids.tolist())
    assert all(float(cum[i]) >= 0.01 for i in kept) and _closed(tree, draft)
    assert all(float(cum[i]) < 0.01 for i in range(draft.num_nodes + 1) if i not in kept)
    assert len(kept) < draft.num_nodes + 1  # some were removed
    # A ratio above 1 never pays off: no draft forward at all, the root alone.
    draft, adapter = synthetic_tree(geometric(64, 0.6))
    assert PCTPolicy(PCTConfig(cost_ratio=1.5)).build_tree(draft).num_nodes == 0 and adapter.calls == []


def test_pct_cost_ratio_comes_from_the_machine_unless_configured():
    costs = ForwardCosts(
        sizes=(1, 2), target_s=(0.04, 0.05), draft_s=(0.002, 0.0025), prefix_tokens=8, runs=1
    )
    policy = get_policy("pct")
    assert policy.cost_ratio is None and "cost_ratio" in policy.free_hardware_options()
    policy.fit(costs)
    assert policy.cost_ratio == pytest.approx(0.05) and policy.config.max_nodes == costs.node_budget()
    configured = get_policy("pct", cost_ratio=0.3)
    configured.fit(costs)
    assert configured.cost_ratio == 0.3 and "cost_ratio" not in configured.free_hardware_options()
    with pytest.raises(ValueError, match=r"cost_ratio=-1"):
        get_policy("pct", cost_ratio=-1)
    unmeasured = get_policy("pct")
    draft, _ = synthetic_tree(geometric(64, 0.6))
    with pytest.warns(UserWarning, match="no cost ratio"):
        unmeasured.build_tree(draft)


# ---- configs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("eagle2", "depth", 0),
        ("eagle2", "total_tokens", -3),
        ("wetap", "w_max", 8),
        ("wetap", "gamma", -1.0),
        ("wetap", "alpha", 1.5),
        ("wetap", "top_p", 0.0),
        ("wetap", "acceptance", "sampled"),
        ("wetap", "tau", 0.0),
        ("c2t", "beta", 1.5),
        ("c2t", "top_k", 0),
        ("c2t", "classifier", "/no/such/classifier.safetensors"),
        ("pct", "cost_ratio", -0.1),
        ("pct", "leaf_threshold", 2.0),
        ("pct", "width", 0),
    ],
)
def test_bad_config_values_are_named(name, option, value):
    with pytest.raises(ValueError, match=re.escape(f"{option}={value!r}")):
        get_policy(name, **{option: value})


@pytest.mark.parametrize(
    ("name", "config_class"),
    [("eagle2", EAGLE2Config), ("wetap", WETAPConfig), ("c2t", C2TConfig), ("pct", PCTConfig)],
)
def test_yaml_configs_hold_the_defaults(name, config_class):
    assert config_class.from_yaml(ROOT / "configs" / "policies" / f"{name}.yaml") == config_class()


# ---- lossless on the tiny pairs --------------------------------------------------------------------------------
MAX_NEW = 40
EXTRA_POLICIES = ("eagle2", "wetap", "c2t", "pct")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models run many small ops: one intra-op thread is faster than several, and the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def family_cases(request, tiny_pairs):
    """A pipeline per family and the reference outputs: every input kind x 2 prompts (rotating over the 5)."""
    pair = tiny_pairs[request.param]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    cases = []
    for k, (kind, image, video) in enumerate(input_kinds()):
        for prompt in (PROMPTS[k % len(PROMPTS)], PROMPTS[(k + 2) % len(PROMPTS)]):
            inputs = pipe.prepare_inputs(image, prompt, video)
            out = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=MAX_NEW)
            cases.append((kind, prompt, image, video, out[0, inputs["input_ids"].shape[1] :].tolist()))
    return request.param, pipe, cases


@pytest.mark.parametrize("policy", EXTRA_POLICIES)
def test_greedy_equals_generate(family_cases, policy):
    family, pipe, cases = family_cases
    # PCT: a GPU-like s_d/s_t, so that its trees have depth (the tiny pair's CPU ratio, ~0.6, expands little;
    # the ratio only shapes the tree, never the output).
    pipe.policy = get_policy(policy, cost_ratio=0.1) if policy == "pct" else get_policy(policy)
    accepted = 0
    for kind, prompt, image, video, expected in cases:
        out = pipe(image, prompt, video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == expected, f"{family}/{policy}/{kind}/{prompt!r}"
        assert out.stats.lossless and out.stats.new_tokens == len(expected)
        accepted += out.stats.accepted_tokens
    assert accepted > 0, f"{family}/{policy}: the draft was never accepted"


def test_measure_cost_ratio_on_a_tiny_pair(tiny_pairs):
    pair = tiny_pairs["llava_onevision"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    ratio = measure_cost_ratio(pipe.target, pipe.draft, context=16, warmup=1, repeats=3)
    assert 0 < ratio < math.inf
    with pytest.raises(ValueError, match="runs=0"):
        measure_cost_ratio(pipe.target, pipe.draft, repeats=0)


def test_wetap_beam_run_reports_not_lossless(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    with pytest.warns(UserWarning, match="wetap_beam"):
        pipe = VLMSpecPipeline.from_pretrained(
            pair.target, pair.draft, policy="wetap", torch_dtype=torch.float32, acceptance="wetap_beam"
        )
    out = pipe(None, PROMPTS[0], max_new_tokens=16)
    assert out.stats.lossless is False and out.stats.new_tokens == 16


# ---- C2T tooling -----------------------------------------------------------------------------------------------
def test_c2t_collect_train_and_load(tiny_pairs, tmp_path):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    data = tmp_path / "trees.safetensors"
    summary = collect(
        pipe, [Example(prompt=PROMPTS[0]), (None, PROMPTS[1])], data, depth=3, top_k=3, max_new_tokens=12
    )
    assert pipe.policy.name == "sage"  # restored
    # Full EAGLE-2 trees without rerank: 3 + 2 * 9 = 21 nodes (fewer in the last steps near max_new_tokens).
    assert summary["trees"] >= 2 and 0 < summary["positives"] <= summary["nodes"] <= 21 * summary["trees"]
    out = tmp_path / "clf.safetensors"
    metrics = train(data, out, epochs=3, batch_size=64)
    assert 0 <= metrics["recall"] <= 1 and 0 <= metrics["positive_rate"] <= 1
    assert (
        c2t_main(["train", "--data", str(data), "--out", str(tmp_path / "cli.safetensors"), "--epochs", "1"])
        == 0
    )
    assert (tmp_path / "cli.json").is_file()
    named = ["--target", "testbed-mini", "--prompts-per-kind", "1", "--max-new-tokens", "4", "--depth", "2"]
    assert (
        c2t_main(["collect", *named, "--out", str(tmp_path / "named.safetensors")]) == 0
    )  # no --draft needed
    assert load_file(tmp_path / "named.safetensors")["labels"].numel() > 0
    policy = get_policy("c2t", classifier=str(out), beta=0.3)
    assert policy.classifier.spec["training"]["epochs"] == 3
    pipe.policy = policy
    inputs = pipe.prepare_inputs(None, PROMPTS[2])
    expected = pipe.target.generate(**inputs, do_sample=False, max_new_tokens=16)[
        0, inputs["input_ids"].shape[1] :
    ]
    assert pipe(None, PROMPTS[2], max_new_tokens=16).token_ids == expected.tolist()


def _table(rows: dict[int, dict[int, float]]):
    return table(rows, vocab=12)


def test_eagle2_expands_the_nodes_of_highest_cumulative_probability():
    """Token 2 (0.9) has flat children, token 3 (0.1) one sure child: by their own probability 3's child (0.95)
    would be expanded first, by the path's (EAGLE-2) 2's two children are (0.27 and 0.225 against 0.095)."""
    from vlmspec.policies.eagle2 import eagle2_expand

    rows = {1: {2: 0.9, 3: 0.1}, 2: {4: 0.3, 5: 0.25, 6: 0.2, 7: 0.15, 8: 0.1}, 3: {9: 0.95, 0: 0.05}}
    draft, _ = synthetic_tree(_table(rows))
    expanded = _recording(draft)
    eagle2_expand(draft, depth=3, top_k=2)
    assert draft.tokens[expanded].tolist() == [1, 2, 3, 4, 5]  # root, level 1, then level 2's best two


def test_sage_gives_each_parent_a_width_from_its_own_probability():
    """Eq. 12: W_l(parent) = ceil(W / l * (0.5 + P(parent))), P the parent's own draft probability: at level 3 a
    parent with P = 0.9 on a path of 0.45 gets ceil(2 * 1.4) = 3 children (its path's would give 2)."""
    rows = {1: {2: 0.5, 3: 0.5}, 2: {4: 0.9, 5: 0.1}, 3: {4: 0.9, 5: 0.1}}
    draft, _ = synthetic_tree(_table(rows))
    policy = SAGEPolicy(SAGEConfig(theta_scale=1e-4, n_max=200, top_k=12))
    width, depth = 6, 3
    policy._grow_adaptive(draft, draft.next_probs(torch.zeros(1, dtype=torch.long)), depth, width)
    children = torch.bincount(draft.parents[1:], minlength=draft.num_nodes + 1)
    parents = (draft.depths == 2).nonzero().flatten().tolist()
    assert len(parents) == 4
    for node in parents:
        assert int(children[node]) == math.ceil(width / 3 * (0.5 + float(draft.probs[node]))), node
    assert sorted(int(children[n]) for n in parents) == [2, 2, 3, 3]
