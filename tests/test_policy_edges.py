"""Tree policies on synthetic drafts where the documented rule and a near miss of it part ways: which candidates a
node budget keeps, per-request state, refitting to the machine or a batch, WETAP's widths, filters and pruning
order, C2T's features, and the defaults the README lists."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
from synthetic import geometric, peaked, synthetic_tree, table

from vlmspec.costs import ForwardCosts
from vlmspec.policies import (
    C2TConfig,
    C2TPolicy,
    EAGLE2Config,
    PCTConfig,
    PCTPolicy,
    SAGEConfig,
    SAGEPolicy,
    StepFeedback,
    WETAPConfig,
    WETAPPolicy,
    distribution_entropy,
    get_policy,
    policy_class,
    wetap_prune,
)
from vlmspec.policies.eagle2 import MAX_EXPANSION_NODES

ROOT = Path(__file__).resolve().parents[1]


def _table(rows: dict[int, dict[int, float]]):
    return table(rows, vocab=64)


# Token 2 (0.9) has two likely children, token 3 (0.1) one sure one: by its own probability 3's child 6 (0.8) leads,
# by the path's (cumulative) 2's child 4 does (0.495 against 0.08).
BUDGET_ROWS = {1: {2: 0.9, 3: 0.1}, 2: {4: 0.55, 5: 0.45}, 3: {6: 0.8, 7: 0.2}}


def _level_two_tokens(tree) -> list[int]:
    return sorted(tree.tokens[tree.depths == 2].tolist())


def test_sage_n_max_keeps_the_level_s_most_probable_paths():
    """Sec. "Choices": when a level would exceed N_max, its candidates of highest cumulative probability stay."""
    draft, _ = synthetic_tree(_table(BUDGET_ROWS))
    tree = SAGEPolicy(SAGEConfig(n_max=3)).build_tree(draft)
    assert tree.num_nodes == 3 and _level_two_tokens(tree) == [4]


def test_pct_max_nodes_keeps_the_level_s_most_confident_candidates():
    """PCT's cap keeps a level's candidates of highest cumulative confidence (its acceptance estimate)."""
    policy = PCTPolicy(PCTConfig(cost_ratio=0.01, leaf_threshold=0.0, width=2, max_nodes=3))
    draft, _ = synthetic_tree(_table(BUDGET_ROWS))
    tree = policy.build_tree(draft)
    assert tree.num_nodes == 3 and _level_two_tokens(tree) == [4]


@pytest.mark.parametrize("name", ["sage", "sage_paper"])
def test_a_new_request_starts_from_the_policy_s_initial_state(name):
    """begin() (the engine calls it before each request) clears what an earlier request left: SAGE's lookahead
    alpha, its history-lowered D_max, and sage_paper's static first tree."""

    def first_tree(policy):
        draft, _ = synthetic_tree(geometric(64, 0.7))
        tree = policy.build_tree(draft)
        return tree.tokens.tolist(), tree.parents.tolist(), policy.trace()

    expected = first_tree(get_policy(name))
    policy = get_policy(name)
    policy.begin(None)
    for _ in range(2):  # an earlier request: a confident draft, then a window of rejected steps
        draft, _ = synthetic_tree(peaked(64, 0.99))
        policy.build_tree(draft)
    for step in range(policy.config.window):
        policy.feedback(StepFeedback(step=step, accepted=0, tree_size=8))
    draft, _ = synthetic_tree(geometric(64, 0.7))
    policy.build_tree(draft)
    assert policy.trace()["max_depth"] == policy.config.d_max - 1  # the earlier request did change the state
    policy.begin(None)
    assert first_tree(policy) == expected


def _costs(target_s: tuple[float, ...], draft_s: tuple[float, ...] | None = None) -> ForwardCosts:
    sizes = (1, 2, 4, 8, 16, 32, 64)
    return ForwardCosts(sizes=sizes, target_s=target_s, draft_s=draft_s, prefix_tokens=8, runs=1)


def test_a_static_tree_fitted_to_the_machine_has_the_fitted_number_of_nodes():
    """fit() truncates the static paths to the machine's node budget; the trees built after it follow them."""
    costs = _costs((0.010, 0.015, 0.020, 0.030, 0.040, 0.060, 0.080), (0.002,) * 7)
    policy = get_policy("static")
    policy.fit(costs)
    budget = costs.node_budget()
    assert len(policy.config.paths) == budget < 63
    draft, _ = synthetic_tree(geometric(64, 0.6))
    assert policy.build_tree(draft).num_nodes == budget


def test_pct_refitted_for_a_batch_uses_the_batch_s_cost_ratio():
    """A batch refits a copy of the pipeline's policy with rows = batch size (pipe.batch_policy): PCT's s_d / s_t
    is then one forward of each model for all the rows, not the ratio measured for one row."""
    costs = _costs(
        (0.010, 0.011, 0.012, 0.014, 0.020, 0.030, 0.050), (0.004, 0.006, 0.009, 0.012, 0.016, 0.02, 0.03)
    )
    policy = get_policy("pct")
    policy.fit(costs)
    assert policy.cost_ratio == pytest.approx(costs.draft_cost(1) / costs.target_cost(1))
    batch = copy.copy(policy)
    batch.fit(costs, rows=4)
    assert batch.cost_ratio == pytest.approx(costs.draft_cost(4) / costs.target_cost(4))
    assert batch.cost_ratio != pytest.approx(policy.cost_ratio)


def test_eagle2_depth_budget_stays_within_the_expansion_bound_of_a_wide_top_k():
    """A depth fitted to the machine (or the bench's --budget) is lowered to what the user's top_k allows, rather
    than producing a config its own check refuses."""
    config = EAGLE2Config(top_k=30)
    fitted = config.with_budget(nodes=20, depth=12)
    assert fitted.depth == MAX_EXPANSION_NODES // 30**2 < 12 and fitted.total_tokens == 20
    assert EAGLE2Config().with_budget(depth=12).depth == 12  # top_k 10: depth 12 is within the bound


# ---- WETAP -----------------------------------------------------------------------------------------------------
def test_wetap_first_layer_has_w_min_nodes():
    """Algorithm 1 line 7: layer 1 holds W_1 = W_min of the root's candidates (10 pass top-K/top-P here)."""
    policy = WETAPPolicy(WETAPConfig(length=1, w_min=3, w_max=9))
    draft, _ = synthetic_tree(geometric(64, 0.8))
    tree = policy.build_tree(draft)
    assert policy.trace()["widths"] == [3] and tree.num_nodes == 3


def test_wetap_never_drafts_a_candidate_its_parent_s_top_p_filtered_out():
    """Token 2 (0.5) puts 0.95 on token 5: top-P 0.9 keeps only that child, although its second child 6 (path
    0.5 * 0.04 = 0.02) is likelier than any child of token 3 (0.45 * 0.04 = 0.018), which all pass top-P."""
    rows = {
        1: {2: 0.5, 3: 0.45, 4: 0.05},
        2: {5: 0.95, 6: 0.04},
        3: {**{t: 0.04 for t in range(10, 20)}, **{t: 0.015 for t in range(20, 60)}},
    }
    policy = WETAPPolicy(WETAPConfig(length=2, w_min=2, w_max=4))
    draft, _ = synthetic_tree(_table(rows))
    tree = policy.build_tree(draft)
    assert policy.trace()["widths"] == [2, 4]
    level_two = _level_two_tokens(tree)
    assert 6 not in level_two and 5 in level_two and len(level_two) == 4


def test_wetap_re_pruning_drops_a_parent_left_childless_before_a_likelier_deepest_leaf():
    """Budget 2 by score keeps 2 and 4 (alpha 0.2 favours depth); repairing 4's parent 3 and 2's parent 1 gives 4
    nodes. No leaf is shallower than the deepest layer, so the lowest-probability leaves go: 4 (0.05), then its
    parent 3 (0.06, now a leaf), not the deepest layer's 2 (0.45)."""
    parents, depths = torch.tensor([-1, 0, 1, 0, 3]), torch.tensor([0, 1, 2, 1, 2])
    cum = torch.tensor([1.0, 0.5, 0.45, 0.06, 0.05])
    assert wetap_prune(parents, depths, cum, budget=2, alpha=0.2, length=2).tolist() == [0, 1, 2]


# ---- C2T -------------------------------------------------------------------------------------------------------
class _RecordingClassifier(torch.nn.Module):
    """Confidence = the joint probability; records the features it scores."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.seen.append(features.clone())
        return features[..., 0]


def test_c2t_scores_each_layer_with_its_depth_and_the_configured_entropy_top():
    """The features are (joint probability, entropy over the parent's top-``entropy_top`` probabilities, depth
    with the root's children at 1): what the shipped classifier was trained on."""
    dist = geometric(64, 0.5)
    policy = C2TPolicy(C2TConfig(beta=0.05, top_k=2, max_depth=3, entropy_top=4))
    policy.classifier = _RecordingClassifier()
    draft, _ = synthetic_tree(dist)
    policy.build_tree(draft)
    seen = policy.classifier.seen
    assert len(seen) == 3
    row = dist(torch.tensor([1]), torch.tensor([0]))  # every row is a rotation of this one
    top4 = float(distribution_entropy(row, 4))
    assert top4 != pytest.approx(float(distribution_entropy(row, 1000)), rel=1e-3)
    for level, features in enumerate(seen, start=1):
        assert (features[..., 2] == level).all()
        assert features[..., 1].flatten().tolist() == pytest.approx(
            [top4] * features[..., 1].numel(), rel=1e-4
        )


# ---- the README's table of defaults ----------------------------------------------------------------------------
def _readme_defaults() -> dict[str, dict[str, str]]:
    """``{policy: {option: value}}`` from the README's policy table (first code span of the options column)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Policies", 1)[1].split("\n\n", 2)[1]
    table: dict[str, dict[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.match(r"`(\w+)`", cells[0]) if len(cells) >= 3 else None
        spans = re.findall(r"`([^`]*)`", cells[-1]) if name else []
        if not spans:
            continue
        options = {}
        for item in spans[0].split(","):
            match = re.fullmatch(r"(\w+) ([\w.]+)\*?", item.strip())
            if match:
                options[match.group(1)] = match.group(2)
        table[name.group(1)] = options
    return table


def _value(written: str) -> object:
    """A README value as Python reads it: ``none`` is None, numbers are numbers, the rest are strings."""
    if written == "none":
        return None
    try:
        return float(written)
    except ValueError:
        return written


def test_the_readme_lists_each_policy_s_defaults():
    """ "The defaults shown are what a policy uses outside a pipeline": every option the README's table gives a value
    is the config class's default."""
    table = _readme_defaults()
    assert {"sage", "sage_paper", "chain", "eagle2", "wetap", "c2t", "pct", "dsbd"} <= set(table)
    checked = 0
    for name, options in table.items():
        config = policy_class(name).config_class()
        for option, written in options.items():
            assert hasattr(config, option), (name, option)
            assert getattr(config, option) == _value(written), (name, option)
            checked += 1
    assert checked >= 40
