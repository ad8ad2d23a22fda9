"""SAGE's formulas (sage.txt Eq. 7-12, section 5.1) on synthetic draft distributions."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from synthetic import geometric, peaked, synthetic_tree

from vlmspec.costs import ForwardCosts
from vlmspec.policies import SAGEConfig, SAGEPaperConfig, SAGEPolicy, StepFeedback, confidence, get_policy
from vlmspec.policies.sage import COST_FIELDS

ROOT = Path(__file__).resolve().parents[1]


def test_confidence_uniform_topk_is_zero_and_one_hot_is_one():
    uniform = torch.full((50,), 1 / 50)
    one_hot = torch.zeros(50)
    one_hot[7] = 1.0
    assert float(confidence(uniform, 10)) == pytest.approx(0.0, abs=1e-6)
    assert float(confidence(one_hot, 10)) == pytest.approx(1.0, abs=1e-6)
    # Eq. 7-9 by hand for a two-level top-k: renormalise, entropy, complement.
    probs = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1])
    p = probs[:4] / probs[:4].sum()
    expected = 1 - float(-(p * p.log()).sum()) / math.log(4)
    assert float(confidence(probs, 4)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(("alpha", "depth", "width"), [(0.0, 3, 10), (0.5, 6, 6), (1.0, 8, 2)])
def test_depth_and_width_follow_eq_10_11(alpha, depth, width):
    c = SAGEPaperConfig()
    assert (c.d_min, c.d_max, c.w_min, c.w_max, c.top_k, c.n_max, c.window, c.lower, c.upper) == (
        3,
        8,
        2,
        10,
        10,
        64,
        10,
        2.0,
        3.0,
    )
    # D(0.5) = 3 + 0.5 * 5 = 5.5 -> 6 (half-up); W(0.5) = 2 + 0.5 * 8 = 6.
    assert c.depth(alpha, c.d_max) == depth
    assert c.width(alpha) == width
    assert c.threshold(2, 4) == pytest.approx(0.1 * 2 / 4)


def _two_steps(policy: SAGEPolicy, dist_fn):
    """Step 1 measures the draft's confidence; step 2's tree is shaped by it (lookahead)."""
    first, _ = synthetic_tree(dist_fn)
    policy.build_tree(first)
    second, adapter = synthetic_tree(dist_fn)
    tree = policy.build_tree(second)
    return tree, policy.trace(), adapter


def _widths(tree) -> list[int]:
    return torch.bincount(tree.depths[1:]).tolist()[1:]


def test_confident_draft_builds_deeper_narrower_tree_than_uncertain():
    vocab = 64
    paper = SAGEConfig(growth="paper")
    confident_tree, confident, _ = _two_steps(SAGEPolicy(paper), peaked(vocab, 0.97))
    uncertain_tree, uncertain, _ = _two_steps(SAGEPolicy(paper), geometric(vocab, 0.8))
    assert confident["alpha"] > 0.8 > 0.3 > uncertain["alpha"]
    assert confident["depth"] > uncertain["depth"] and confident["width"] < uncertain["width"]
    assert confident_tree.max_depth > uncertain_tree.max_depth
    assert max(_widths(confident_tree)) < max(_widths(uncertain_tree))
    assert confident_tree.num_nodes <= 64 and uncertain_tree.num_nodes <= 64


def test_lookahead_uses_previous_steps_confidence():
    policy = SAGEPolicy(SAGEConfig(growth="paper", confidence="lookahead"))
    first, _ = synthetic_tree(peaked(32, 0.9))
    policy.build_tree(first)
    assert policy.trace()["alpha"] == 0.5  # Algorithm 1 initialises alpha to 0.5
    root_probs = peaked(32, 0.9)(torch.tensor([1]), torch.tensor([0]))[0]
    second, _ = synthetic_tree(geometric(32, 0.7))
    policy.build_tree(second)
    assert policy.trace()["alpha"] == pytest.approx(float(confidence(root_probs, 10)), rel=1e-5)


def test_root_confidence_shapes_this_steps_tree():
    policy = SAGEPolicy(SAGEConfig(growth="paper", confidence="root"))
    assert SAGEConfig().confidence == "lookahead" == get_policy("sage_paper").config.confidence
    for dist in (peaked(32, 0.9), geometric(32, 0.7), peaked(32, 0.5)):
        draft, _ = synthetic_tree(dist)
        policy.build_tree(draft)
        root_probs = dist(torch.tensor([1]), torch.tensor([0]))[0]
        assert policy.trace()["alpha"] == pytest.approx(float(confidence(root_probs, 10)), rel=1e-5)
    with pytest.raises(ValueError, match="confidence='next'"):
        SAGEConfig(confidence="next")


@pytest.mark.parametrize("n_max", [5, 17, 64])
def test_n_max_theta_and_widths_are_respected(n_max):
    policy = SAGEPolicy(SAGEConfig(growth="paper", n_max=n_max, init_alpha=0.0, confidence="lookahead"))
    draft, _ = synthetic_tree(geometric(64, 0.85))
    tree = policy.build_tree(draft)
    trace = policy.trace()
    c = policy.config
    assert 0 < tree.num_nodes <= n_max
    assert tree.max_depth <= trace["depth"]
    depths = tree.depths
    for node in range(1, tree.num_nodes + 1):
        level = int(depths[node])
        cum = float(draft.cum_probs[node])
        assert cum > c.threshold(level, trace["depth"])  # theta_l = 0.1 * l / D(alpha)
        siblings = (tree.parents == tree.parents[node]).nonzero().flatten()
        rank = int((draft.probs[siblings] > draft.probs[node]).sum())
        parent = int(tree.parents[node])
        limit = (
            trace["width"]
            if level == 1
            else math.ceil(trace["width"] / level * (0.5 + float(draft.probs[parent])))
        )
        assert rank < limit  # path index p_l < W_l (Eq. 12)


@pytest.mark.parametrize("growth", ["paper", "cost"])
def test_one_forward_per_level(growth):
    policy = SAGEPolicy(SAGEConfig(growth=growth, init_alpha=0.3, node_cost=0.01, level_cost=0.01))
    draft, adapter = synthetic_tree(geometric(64, 0.6))
    tree = policy.build_tree(draft)
    # The root's forward, then each forward covers one whole level (all its nodes at once).
    assert adapter.calls[0] == 1
    assert adapter.calls[1:] == _widths(tree)[: len(adapter.calls) - 1]
    assert len(adapter.calls) >= tree.max_depth


def _grown_by_cost(dist_fn, **options):
    policy = SAGEPolicy(SAGEConfig(**options))
    draft, adapter = synthetic_tree(dist_fn)
    return policy.build_tree(draft), draft, adapter


def test_cost_growth_keeps_what_repays_its_verification():
    dist = geometric(64, 0.6)
    sizes = [
        _grown_by_cost(dist, node_cost=cost, level_cost=0.05)[0].num_nodes for cost in (0.0, 0.03, 0.1, 0.2)
    ]
    assert sizes[0] > SAGEConfig().n_max // 2  # free verification: most of the budget
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3] >= 1  # dearer nodes: fewer of them
    tree, draft, _ = _grown_by_cost(dist, node_cost=0.05, level_cost=0.02)
    # The root's children: every token whose probability beats the first bar, (V / T) * node_cost with V = 1 and
    # T = 1 + one draft forward, and no other.
    root_probs = dist(torch.tensor([1]), torch.tensor([0]))[0]
    expected = int((root_probs * (1 + 0.02) > 0.05).sum())
    kept = draft.probs[1:][tree.parents[1:] == 0]
    assert 1 < len(kept) == expected < 10 and float(kept.min()) * 1.02 > 0.05


def test_cost_growth_follows_each_node_s_confidence():
    confident, _, _ = _grown_by_cost(peaked(64, 0.97), node_cost=0.02, level_cost=0.05)
    uncertain, _, _ = _grown_by_cost(geometric(64, 0.5), node_cost=0.02, level_cost=0.05)
    # A peaked draft: one child per node, as deep as D_max allows; a flat one: wider and shallower.
    assert _widths(confident) == [1] * SAGEConfig().d_max
    assert uncertain.max_depth < confident.max_depth and max(_widths(uncertain)) > 1


def test_cost_growth_keeps_depth_where_nodes_are_free():
    """A flat verification curve (node_cost 0): each level keeps at most half the budget left, so the confident
    path still runs deep instead of the budget going to the first two levels' unlikely siblings."""
    tree, draft, _ = _grown_by_cost(peaked(64, 0.9), n_max=63, d_max=63, node_cost=0.0, level_cost=0.05)
    assert tree.max_depth >= 6
    assert all(width <= (63 - sum(_widths(tree)[:i]) + 1) // 2 for i, width in enumerate(_widths(tree)))
    # peaked(): token t's likeliest child is t + 1; that path runs from the root to the deepest level.
    tokens, parents, node = draft.tokens.tolist(), draft.parents.tolist(), 0
    for level in range(1, tree.max_depth + 1):
        likeliest = [i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == tokens[node] + 1]
        assert likeliest, f"the likeliest path stops above level {level}"
        node = likeliest[0]


def test_cost_growth_runs_the_draft_again_only_when_a_level_pays():
    forwards = []
    for level_cost in (0.0, 0.05, 0.3, 1.0):
        tree, _, adapter = _grown_by_cost(peaked(64, 0.8), node_cost=0.03, level_cost=level_cost)
        assert len(adapter.calls) == tree.max_depth  # no forward whose level was not kept
        forwards.append(len(adapter.calls))
    assert forwards[0] == SAGEConfig().d_max  # free forwards: as deep as allowed
    assert forwards == sorted(forwards, reverse=True) and forwards[-1] < forwards[1]  # dearer: fewer


def test_a_pipeline_fits_the_node_and_level_costs_unless_set():
    costs = ForwardCosts(sizes=(1, 2, 4, 8, 16, 32), target_s=(1.0, 1.0, 1.1, 1.2, 1.6, 2.0), draft_s=(0.1,) * 6,
                         prefix_tokens=8, runs=1)  # fmt: skip
    policy = get_policy("sage")
    assert set(COST_FIELDS) <= set(policy.free_hardware_options())
    policy.fit(costs)
    node, level = costs.tree_costs(policy.config.n_max)
    assert (policy.config.node_cost, policy.config.level_cost) == (node, level) and level == pytest.approx(
        0.1
    )
    user = get_policy("sage", node_cost=0.3)
    user.fit(costs)
    assert (user.config.node_cost, user.config.level_cost) == (0.3, level)
    paper = get_policy("sage_paper")
    assert not set(COST_FIELDS) & set(paper.free_hardware_options())
    with pytest.raises(ValueError, match="growth='wide'"):
        get_policy("sage", growth="wide")
    with pytest.raises(ValueError, match="node_cost=-1"):
        get_policy("sage", node_cost=-1)


def test_first_step_uses_static_initial_tree():
    policy = get_policy("sage_paper")
    draft, _ = synthetic_tree(geometric(64, 0.6))
    tree = policy.build_tree(draft)
    assert tree.num_nodes == 63 and tree.max_depth == 4


def _feed(policy: SAGEPolicy, values: list[int]) -> None:
    for i, v in enumerate(values):
        policy.feedback(StepFeedback(step=i, accepted=v, tree_size=10))


def test_history_moves_max_depth_only_outside_thresholds():
    policy = SAGEPolicy(SAGEPaperConfig())
    assert policy._max_depth == 8
    _feed(policy, [1] * 9)
    assert policy._max_depth == 8  # window not full yet
    _feed(policy, [1])
    assert policy._max_depth == 7  # mean 1 < lower 2
    _feed(policy, [2, 3] * 5)
    assert policy._max_depth == 7  # mean 2.5 within [2, 3]: hysteresis
    _feed(policy, [3] * 10)
    assert policy._max_depth == 7  # mean exactly 3 is not above the upper threshold
    _feed(policy, [5] * 10)
    assert policy._max_depth == 8  # mean 5 > upper 3
    _feed(policy, [5] * 10)
    assert policy._max_depth == 8  # never above d_max
    _feed(policy, [0] * 100)
    assert policy._max_depth == 3  # never below d_min
    # The adjusted maximum is the D_max of Eq. 10.
    draft, _ = synthetic_tree(peaked(32, 0.99))
    policy.build_tree(draft)
    assert policy.trace()["max_depth"] == 3 and policy.trace()["depth"] == 3


@pytest.mark.parametrize(
    ("option", "value"), [("d_min", 0), ("w_max", 1), ("top_k", 1), ("n_max", 0), ("init_alpha", 1.5)]
)
def test_bad_config_values_are_named(option, value):
    with pytest.raises(ValueError, match=rf"{option}={value}"):
        get_policy("sage", **{option: value})


def test_a_depth_below_the_default_range_lowers_the_range_s_floor_unless_set():
    assert (get_policy("sage", d_max=4).config.d_min, get_policy("sage", d_max=4).config.d_max) == (4, 4)
    assert get_policy("sage", d_max=8).config.d_min == SAGEConfig().d_min  # within the range: as it was
    with pytest.raises(ValueError, match=r"d_max=4 is invalid: an integer >= d_min \(6\)"):
        get_policy("sage", d_min=6, d_max=4)  # both set: the user's contradiction is named


def test_yaml_configs_hold_the_defaults_and_the_papers_settings():
    assert SAGEConfig.from_yaml(ROOT / "configs" / "policies" / "sage.yaml") == SAGEConfig()
    paper = SAGEPaperConfig.from_yaml(ROOT / "configs" / "policies" / "sage_paper.yaml")
    assert paper == SAGEPaperConfig() == get_policy("sage_paper").config
    assert (paper.d_min, paper.d_max, paper.w_max, paper.n_max, len(paper.initial_paths)) == (
        3,
        8,
        10,
        64,
        63,
    )
    assert get_policy("sage").config == SAGEConfig() and SAGEConfig().initial_paths == ()
    # One line away: get_policy takes the file; its options are the user's, the rest still follow the machine.
    literal = get_policy("sage_paper", ROOT / "configs" / "policies" / "sage_paper.yaml", top_k=12)
    options = SAGEPaperConfig.yaml_options(ROOT / "configs" / "policies" / "sage_paper.yaml")
    assert (literal.config.d_min, literal.config.d_max, literal.config.top_k) == (3, 8, 12)
    assert set(literal.free_hardware_options()) == {"n_max"} - set(options)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        get_policy("sage", "nope.yaml")
