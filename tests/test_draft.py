"""The draft's view of the sequence stays exact across steps: a draft that *is* the target proposes the target's
own greedy tokens, so every drafted token is accepted at every step, for any tree shape and input kind. A draft
cache that loses, repeats or misplaces a token (e.g. feeding the bonus token twice) breaks this at once."""

from __future__ import annotations

import pytest
import torch
from conftest import input_kinds

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.policies import MC_SIM_7B_63
from vlmspec.testing import FAMILIES

MAX_NEW = 40


@pytest.fixture(scope="module", params=FAMILIES)
def self_drafting(request, tiny_pairs):
    pair = tiny_pairs[request.param]
    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.target, policy="ar", prune_ratio=0, torch_dtype=torch.float32
    )


@pytest.mark.parametrize("policy", ["chain", "static"])
def test_a_draft_equal_to_the_target_has_every_drafted_token_accepted(self_drafting, policy):
    pipe = self_drafting
    # chain: one node per level, all on the greedy path; static: the greedy path (rank 0 at every level) is in it.
    # Both shapes set here: fitted to the machine, a busy machine's cost probe may leave a one-node static tree.
    pipe.policy = get_policy(policy, **({"gamma": 4} if policy == "chain" else {"paths": MC_SIM_7B_63}))
    for kind, image, video in input_kinds():
        out = pipe(image, "Describe it.", video=video, max_new_tokens=MAX_NEW)
        assert out.token_ids == pipe.reference_generate(
            pipe.prepare_inputs(image, "Describe it.", video), MAX_NEW
        )
        depths = [step["accepted"] for step in out.stats.trace]
        # Every step but the last (cut by max_new_tokens or EOS) accepts a full path of the tree's depth.
        full = max(depths)
        assert full >= 3, (kind, depths)
        assert all(d == full for d in depths[:-1]), (kind, policy, depths)


def test_draft_vocab_bans_what_the_target_cannot_verify_and_feeds_a_stand_in():
    """A draft head of 5 ids over a target's 6, of which 4 are tokens both know: the draft's distribution is spread
    over ids 0-3 only; a target id beyond the draft's table is fed as its last row."""
    from vlmspec.draft import DraftVocab

    vocab = DraftVocab(width=6, proposable=4, embeddable=5)
    probs = torch.softmax(vocab.fit(torch.zeros(1, 5)), dim=-1)
    assert torch.allclose(probs, torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0, 0.0]]))
    assert vocab.feed(torch.tensor([2, 5, 9])).tolist() == [2, 4, 4]


def test_draft_vocab_is_bounded_by_the_tokenizer(tiny_pairs):
    """Ids beyond the tokenizer (a padded table's spare rows) are not proposed either."""
    from types import SimpleNamespace

    from vlmspec import VLMSpecPipeline
    from vlmspec.draft import draft_vocab

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    rows = pipe.target.get_input_embeddings().weight.shape[0]
    assert draft_vocab(pipe.target, pipe.draft, pipe.processor).proposable == rows
    smaller = SimpleNamespace(tokenizer=list(range(rows - 10)))  # len() is all draft_vocab reads of it
    assert draft_vocab(pipe.target, pipe.draft, smaller).proposable == rows - 10


def test_a_commit_before_the_draft_ran_keeps_everything_pending():
    """A step whose tree is the root alone (the draft never ran): the pending tokens, then the accepted root, stay
    pending for the next root forward."""
    from synthetic import peaked, synthetic_tree

    from vlmspec.draft import DraftTree

    tree, adapter = synthetic_tree(peaked(16, 0.9))
    builder = DraftTree(adapter, tree.state, torch.tensor(7), 10, torch.tensor([3, 5]), depth_limit=4)
    assert builder.commit(torch.tensor([0]), [-1]).tolist() == [3, 5, 7]


def test_children_at_the_depth_limit_are_kept():
    from synthetic import peaked, synthetic_tree

    tree, _ = synthetic_tree(peaked(16, 0.9), depth_limit=1)
    tree.next_probs(torch.zeros(1, dtype=torch.long))
    assert tree.add(torch.tensor([0]), torch.tensor([4]), torch.tensor([0.9])).numel() == 1
    assert (
        tree.add(torch.tensor([1]), torch.tensor([5]), torch.tensor([0.9])).numel() == 0
    )  # depth 2: dropped


def test_add_best_adds_the_top_scored_candidates_grouped_by_parent():
    """``add_best``: the ``m`` highest-scored of a frontier's ``[F, k]`` candidates, by parent then column, each
    below its own parent with its own probability."""
    from synthetic import peaked, synthetic_tree

    tree, _ = synthetic_tree(peaked(16, 0.9))
    tree.next_probs(torch.zeros(1, dtype=torch.long))
    frontier = tree.add(torch.tensor([0, 0]), torch.tensor([2, 3]), torch.tensor([0.6, 0.3]))  # nodes 1, 2
    tokens = torch.tensor([[4, 5, 6], [7, 8, 9]])
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.7, 0.2, 0.1]])
    score = torch.tensor([[0.1, 0.9, 0.2], [0.8, 0.0, 0.3]])
    ids = tree.add_best(frontier, tokens, probs, score, 3)
    assert ids.tolist() == [3, 4, 5]
    assert tree.tokens[3:].tolist() == [5, 7, 9] and tree.parents[3:].tolist() == [1, 2, 2]
    torch.testing.assert_close(tree.probs[3:], torch.tensor([0.3, 0.7, 0.1]))
    torch.testing.assert_close(tree.cum_probs[3:], torch.tensor([0.6 * 0.3, 0.3 * 0.7, 0.3 * 0.1]))


def test_node_views_are_read_only_and_survive_growth():
    from synthetic import peaked, synthetic_tree

    tree, _ = synthetic_tree(peaked(16, 0.9))
    tree.next_probs(torch.zeros(1, dtype=torch.long))
    n = 100  # past the first capacity: the node arrays grow together
    tree.add(torch.zeros(n, dtype=torch.long), torch.arange(n) % 16, torch.full((n,), 0.01))
    assert tree.num_nodes == n and all(
        len(view) == n + 1 for view in (tree.tokens, tree.parents, tree.depths, tree.probs, tree.cum_probs)
    )
    assert tree.parents[0] == -1 and tree.depths[1:].eq(1).all() and tree.probs[0] == 1.0
    with pytest.raises(AttributeError, match="read-only"):
        tree.tokens = torch.zeros(1)
