"""The draft's view of the sequence stays exact across steps: a draft that *is* the target proposes the target's
own greedy tokens, so every drafted token is accepted at every step, for any tree shape and input kind. A draft
cache that loses, repeats or misplaces a token (e.g. feeding the bonus token twice) breaks this at once."""

from __future__ import annotations

import pytest
import torch
from conftest import input_kinds

from vlmspec import VLMSpecPipeline, get_policy
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
    pipe.policy = get_policy(policy, **({"gamma": 4} if policy == "chain" else {}))
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
