"""Registry, config validation and tree shapes of the baseline policies."""

from __future__ import annotations

import pytest
from synthetic import geometric, synthetic_tree

from vlmspec.policies import (
    MC_SIM_7B_63,
    ChainConfig,
    StaticConfig,
    TreePolicy,
    available_policies,
    get_policy,
)


def test_registry_lists_and_builds_policies():
    assert {"ar", "chain", "static", "sage"} <= set(available_policies())
    policy = get_policy("chain", gamma=4)
    assert isinstance(policy, TreePolicy) and policy.config == ChainConfig(gamma=4) and policy.name == "chain"


def test_unknown_policy_lists_available():
    with pytest.raises(ValueError, match=r"unknown policy 'nope'.*chain"):
        get_policy("nope")


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['gama'\].*gamma"):
        get_policy("chain", gama=3)


@pytest.mark.parametrize("gamma", [0, -2, 2.5])
def test_bad_gamma_is_named(gamma):
    with pytest.raises(ValueError, match=rf"ChainConfig.gamma={gamma}"):
        get_policy("chain", gamma=gamma)


def test_static_paths_need_their_prefixes():
    with pytest.raises(ValueError, match=r"prefix \(0,\)"):
        StaticConfig(paths=((1,), (0, 1)))


def test_chain_is_a_chain_of_gamma_greedy_tokens():
    draft, adapter = synthetic_tree(geometric(32, 0.5))
    tree = get_policy("chain", gamma=5).build_tree(draft)
    assert tree.num_nodes == 5 and tree.max_depth == 5
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 4]
    # geometric(): the top token after t is t + 1.
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert adapter.calls == [1, 1, 1, 1, 1]  # the last node is not expanded


def test_static_tree_has_the_configured_shape_and_ranks():
    draft, adapter = synthetic_tree(geometric(32, 0.5))
    tree = get_policy("static").build_tree(draft)
    assert tree.num_nodes == len(MC_SIM_7B_63) == 63 and tree.max_depth == 4
    # Depth-1 nodes take ranks 0..9 of the root's distribution: tokens 2, 3, ... (rank r -> token t+1+r).
    depth1 = tree.tokens[tree.depths == 1].tolist()
    assert depth1 == [(1 + 1 + r) % 32 for r in range(10)]
    # One forward per level, over exactly the nodes that have children.
    with_children = [len({p[:d] for p in MC_SIM_7B_63 if len(p) > d}) for d in range(1, 4)]
    assert adapter.calls == [1] + with_children


def test_depth_limit_caps_every_policy():
    for name in ("chain", "static", "sage"):
        draft, _ = synthetic_tree(geometric(32, 0.5), depth_limit=2)
        tree = get_policy(name).build_tree(draft)
        assert tree.max_depth <= 2, name
