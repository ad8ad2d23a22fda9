"""Edge cases of the core data paths that the main suites' typical inputs do not reach: deep chains in a tree
built directly, WETAP's beam rule at tau = 1, a reply ending in a special token streamed in pieces, a KV store that
grows while holding rows, image-only pruning."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.cache import _SPARE, KVStore
from vlmspec.pruning import PruningConfig
from vlmspec.streaming import TextPieces
from vlmspec.testing import make_image
from vlmspec.tree import TokenTree, ancestor_matrix
from vlmspec.verify import beam_accept


def _brute_ancestors(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            out[i, j] = True
            j = parents[j]
    return out


@pytest.mark.parametrize("n", range(1, 70))
def test_ancestors_of_a_chain_reach_the_root_at_every_depth(n):
    """A chain of n nodes is the deepest tree of its size (depth n - 1): random trees are shallow, so the number of
    squaring rounds in ancestor_matrix is only exercised here. A side branch off the deepest node as well."""
    chain = [-1, *range(n - 1)]
    assert torch.equal(ancestor_matrix(torch.tensor(chain)), _brute_ancestors(chain))
    broom = [*chain, n - 1, n - 1]
    tree = TokenTree(
        tokens=torch.zeros(n + 2, dtype=torch.long),
        parents=torch.tensor(broom),
        draft_probs=torch.ones(n + 2),
    )
    assert torch.equal(tree.ancestors, _brute_ancestors(broom))
    assert tree.depths.tolist() == [*range(n), n, n]
    assert tree.path_to(n + 1).tolist() == [*range(n), n + 1]


def test_beam_accept_at_tau_one_accepts_a_beam_the_target_rates_as_high_as_the_draft():
    """Eq. 9 accepts a beam whose cumulative target/draft ratio is >= tau: with tau = 1 a beam on which target and
    draft are both certain (ratio exactly 1) is accepted whole."""
    tree = TokenTree(
        tokens=torch.tensor([0, 1, 2, 3]), parents=torch.tensor([-1, 0, 1, 2]), draft_probs=torch.ones(4)
    )
    logits = torch.full((4, 5), float("-inf"))
    for node, token in enumerate([1, 2, 3, 4]):
        logits[node, token] = 0.0  # the target is certain of the chain, then of token 4
    acc = beam_accept(tree, logits, tau=1.0)
    assert acc.path.tolist() == [0, 1, 2, 3] and int(acc.next_token) == 4


class _SpecialTokenizer:
    """Characters are their code points; id 0 is a special token (EOS) that ``skip_special_tokens`` leaves out."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 and skip_special_tokens else "</s>" if i == 0 else chr(i) for i in ids)


def test_streamed_pieces_leave_out_special_tokens_like_the_final_text():
    """A reply ending with EOS: the pipeline's text skips special tokens, so the pieces must too, or the EOS shows
    up in the stream and the last piece repeats the whole reply."""
    tokenizer = _SpecialTokenizer()
    reply = [ord("H"), ord("i"), 0]
    pieces = TextPieces(tokenizer)
    streamed = [pieces.push(reply[:2]), pieces.push(reply[2:])]
    final = tokenizer.decode(reply, skip_special_tokens=True)
    streamed.append(pieces.finish(final))
    assert "".join(streamed) == final == "Hi"
    assert streamed[1:] == ["", ""]


def _prefill(length: int, seed: int) -> DynamicCache:
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(2):
        cache.update(
            torch.randn(1, 2, length, 4, generator=gen), torch.randn(1, 2, length, 4, generator=gen), layer
        )
    return cache


def test_a_growing_kv_store_keeps_the_rows_it_holds():
    """The store is sized for its first prompt plus a spare; a longer later prompt (or a long reply) grows it, and
    every live row's entries must survive the move."""
    store = KVStore(max_rows=2)
    short = _prefill(5, seed=0)
    view = store.add_row(short)
    capacity = store.capacity
    long = _prefill(capacity + 7, seed=1)
    store.add_row(long)
    assert store.capacity > capacity and store.lengths == [5, capacity + 7]
    for layer in range(2):
        keys, values = store.layer(layer)
        assert torch.equal(keys[0, :, :5], short.layers[layer].keys[0])
        assert torch.equal(values[0, :, :5], short.layers[layer].values[0])
        assert torch.equal(keys[1, :, : capacity + 7], long.layers[layer].keys[0])
    # A row's own forward past the capacity grows it too.
    extra = torch.randn(1, 2, store.capacity + _SPARE, 4)
    for layer in range(2):
        view.update(extra, extra, layer)
    assert torch.equal(store.layer(1)[0][1, :, : capacity + 7], long.layers[1].keys[0])
    assert torch.equal(store.layer(0)[0][0, :, :5], short.layers[0].keys[0])


@pytest.mark.parametrize("method", ["uniform", "attention"])
def test_image_only_pruning_prunes_the_image(tiny_pairs, method):
    """A config that prunes images and keeps every video token (video_ratio 0) is enabled: the draft reads fewer
    image tokens than the target, and the output is still the target's."""
    pair = tiny_pairs["qwen2_vl"]
    config = PruningConfig(method=method, image_ratio=0.5, video_ratio=0.0, min_keep=0)
    assert config.enabled
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target,
        pair.draft,
        policy=get_policy("chain", gamma=3),
        pruning=config,
        torch_dtype=torch.float32,
    )
    prompt = "Describe this image."
    out = pipe(make_image(0), prompt, max_new_tokens=8)
    assert 0 < out.stats.draft_visual_tokens < out.stats.target_visual_tokens
    assert out.token_ids == pipe.reference_generate(pipe.prepare_inputs(make_image(0), prompt), 8)


def test_a_batch_verifies_every_live_request_in_each_target_forward(tiny_pairs, monkeypatch):
    """The batcher runs waiting draft forwards before target ones, so requests drafting trees of different depths
    (SAGE's per-request depth) catch up and every verification is one target forward for all live rows: the
    point of batching."""
    import vlmspec.batching as batching

    pair = tiny_pairs["qwen2_vl"]
    # Set, not fitted: up to 8 levels, each node priced low enough that a confident branch runs deep on any machine.
    policy = get_policy("sage", d_min=2, d_max=8, n_max=16, node_cost=0.01, level_cost=0.01)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy=policy, torch_dtype=torch.float32)
    merged: list[tuple[bool, int, int]] = []
    run_merged = batching.run_merged

    def recording(calls):
        store = calls[0].cache.store
        merged.append((calls[0].adapter is pipe.target_adapter, len(calls), store.rows))
        return run_merged(calls)

    monkeypatch.setattr(batching, "run_merged", recording)
    prompts = [
        "Describe this image.",
        "What color is the largest shape?",
        "List three things in the picture.",
    ]
    requests = [{"image": make_image(i), "prompt": p, "max_new_tokens": 16} for i, p in enumerate(prompts)]
    outputs = pipe.batch(requests, batch_size=3)
    assert [o.token_ids for o in outputs] == [
        pipe.reference_generate(pipe.prepare_inputs(r["image"], r["prompt"]), 16) for r in requests
    ]
    verifications = [(calls, rows) for is_target, calls, rows in merged if is_target]
    assert verifications and all(calls == rows for calls, rows in verifications), verifications
    assert len({trace["depth"] for o in outputs for trace in o.stats.trace}) > 1  # the trees' depths differed
