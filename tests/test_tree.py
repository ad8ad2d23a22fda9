"""Property tests of the token tree data, greedy acceptance and KV-cache compaction."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vlmspec.tree import TokenTree, ancestor_matrix
from vlmspec.verify import greedy_accept


@st.composite
def trees(draw, max_nodes: int = 40):
    n = draw(st.integers(0, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n + 1)]
    tokens = draw(st.lists(st.integers(0, 9), min_size=n + 1, max_size=n + 1))
    return TokenTree(
        tokens=torch.tensor(tokens), parents=torch.tensor(parents), draft_probs=torch.ones(n + 1)
    )


def _ancestors_brute(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 50))
def test_mask_is_ancestors_only_and_positions_are_past_plus_depth(tree, past):
    parents = tree.parents.tolist()
    n = len(parents)
    bias = tree.attention_bias(past, torch.float32)
    assert bias.shape == (1, 1, n, past + n)
    visible = bias[0, 0] == 0
    assert visible[:, :past].all()  # the whole prefix is visible
    for i in range(n):
        anc = _ancestors_brute(parents, i)
        assert set(visible[i, past:].nonzero().flatten().tolist()) == anc
        assert int(tree.positions(past)[i]) == past + len(anc) - 1
    assert torch.equal(ancestor_matrix(tree.parents), tree.ancestors)
    assert (bias[0, 0][~visible] == torch.finfo(torch.float32).min).all()


@settings(max_examples=100, deadline=None)
@given(trees())
def test_retrieve_paths_are_root_to_leaf(tree):
    parents = tree.parents.tolist()
    leaves = set(range(len(parents))) - set(parents[1:])
    paths = tree.retrieve_paths()
    assert paths.shape[0] == len(leaves)
    for row in paths.tolist():
        path = [i for i in row if i >= 0]
        assert path[0] == 0 and path[-1] in leaves
        assert all(parents[b] == a for a, b in zip(path, path[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(trees(), st.integers(0, 2**31 - 1))
def test_greedy_accept_is_longest_matching_path(tree, seed):
    n = tree.tokens.shape[0]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 10, generator=gen)
    # Make some nodes correct on purpose so long paths occur.
    choice = logits.argmax(-1)
    for i in range(1, n):
        if torch.rand(1, generator=gen) < 0.6:
            tree.tokens[i] = choice[tree.parents[i]]
    acc = greedy_accept(tree, logits)
    parents = tree.parents.tolist()

    def ok(i: int) -> bool:
        return all(
            int(tree.tokens[j]) == int(choice[parents[j]]) for j in _ancestors_brute(parents, i) if j > 0
        )

    best = max((len(_ancestors_brute(parents, i)) - 1 for i in range(n) if ok(i)), default=0)
    path = acc.path.tolist()
    assert acc.num_accepted == best
    assert path[0] == 0 and all(parents[b] == a for a, b in zip(path, path[1:], strict=False))
    assert all(int(tree.tokens[j]) == int(choice[parents[j]]) for j in path[1:])
    assert int(acc.next_token) == int(choice[path[-1]])
