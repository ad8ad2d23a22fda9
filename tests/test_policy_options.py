"""Policy options mean what the user set: checked where they are given, kept through the hardware fit."""

from __future__ import annotations

import pytest
import torch

from vlmspec import InvalidInputError, VLMSpecPipeline, get_policy

pytestmark = pytest.mark.filterwarnings("ignore::vlmspec.SlowSpeculationWarning")


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", gamma=2, torch_dtype=torch.float32
    )


# ---- rank paths stay within the vocabulary ----------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "option"), [("static", "paths"), ("sage", "initial_paths")])
def test_a_rank_beyond_the_vocabulary_is_refused_when_the_policy_is_attached(pipe, policy, option):
    vocab = pipe._draft_vocab.proposable
    bad = get_policy(policy, **{option: [[0], [0, vocab]]})  # no vocabulary known yet: accepted
    with pytest.raises(InvalidInputError, match=rf"{option} holds the path \[0, {vocab}\], whose rank {vocab} "
                       rf"is beyond this pair's vocabulary of {vocab} tokens: use ranks below {vocab}"):  # fmt: skip
        pipe.policy = bad
    pipe.policy = get_policy(policy, **{option: [[0], [0, vocab - 1]]})  # the last rank there is
    prompt = "Describe a red circle."
    out = pipe(None, prompt, max_new_tokens=4)
    assert out.token_ids == pipe.reference_generate(pipe.prepare_inputs(None, prompt), 4)


@pytest.mark.parametrize("rank", [2**20, 10**30])  # MAX_RANK, and one past a C long
def test_an_absurd_rank_is_refused_with_the_config(rank):
    with pytest.raises(InvalidInputError, match=rf"StaticConfig.paths=\[0, {rank}\] is invalid: ranks below"):
        get_policy("static", paths=[[0], [0, rank]])
