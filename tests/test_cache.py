"""KV-cache compaction: after keeping an accepted tree path, the cache equals a fresh forward on prefix + path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmspec import VLMSpecPipeline
from vlmspec.cache import KVStore, cache_length, copy_cache, keep_tail
from vlmspec.models import adapter_for
from vlmspec.testing import make_image
from vlmspec.tree import TokenTree, tree_attention_bias


@pytest.fixture(scope="module", params=["qwen2_vl", "llava_onevision"])
def model_case(request, tiny_pairs):
    pair = tiny_pairs[request.param]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    inputs = pipe.prepare_inputs(make_image(0), "Describe this image.")
    return adapter_for(pipe.target), inputs


def _extend(inputs: dict, tokens: torch.Tensor) -> dict:
    """The same prompt followed by ``tokens`` as plain text tokens."""
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], tokens[None]], dim=1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    if "mm_token_type_ids" in inputs:
        out["mm_token_type_ids"] = torch.cat(
            [inputs["mm_token_type_ids"], torch.zeros_like(tokens)[None]], dim=1
        )
    return out


@st.composite
def tree_and_node(draw, max_nodes: int = 12, vocab: int = 200):
    n = draw(st.integers(0, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n + 1)]
    tokens = draw(st.lists(st.integers(5, vocab), min_size=n + 1, max_size=n + 1))
    node = draw(st.integers(0, n))
    return parents, tokens, node


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=tree_and_node())
def test_compacted_cache_matches_fresh_forward(model_case, case):
    adapter, inputs = model_case
    parents, tokens, node = case
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), torch.ones(len(tokens)))
    prompt_len = inputs["input_ids"].shape[1]

    state = adapter.prefill(inputs).state
    past = state.length
    adapter.forward(state, tree.tokens, tree.positions(prompt_len), tree.attention_bias(past, torch.float32))
    path = tree.path_to(node)
    keep_tail(state.cache, past, past + path)
    assert cache_length(state.cache) == past + path.shape[0]

    fresh = adapter.prefill(_extend(inputs, tree.tokens[path])).state
    for kept, ref in zip(state.cache.layers, fresh.cache.layers, strict=True):
        assert (kept.keys - ref.keys).abs().max() <= 1e-4
        assert (kept.values - ref.values).abs().max() <= 1e-4
    # And decoding on from the compacted cache gives the fresh model's next-token logits.
    nxt = torch.tensor([7])
    pos = torch.tensor([prompt_len + path.shape[0]])
    ones = torch.ones(1, 1, dtype=torch.bool)
    a = adapter.forward(state, nxt, pos, tree_attention_bias(ones, cache_length(state.cache), torch.float32))
    b = adapter.forward(fresh, nxt, pos, tree_attention_bias(ones, cache_length(fresh.cache), torch.float32))
    assert (a - b).abs().max() <= 1e-4


def test_a_batched_forward_writes_each_row_at_its_length_and_counts_only_real_tokens():
    """Rows of 5 and 3 entries, a forward of 2 tokens of which row 1's are padding: row 0's go to slots 5-6, the
    lengths become [7, 3] (padding past a row's length is never counted)."""
    from transformers.cache_utils import DynamicCache

    from vlmspec.cache import BatchCache, KVStore

    store = KVStore(max_rows=2)
    for length in (5, 3):
        prefill = DynamicCache()
        prefill.update(torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4), 0)
        store.add_row(prefill)
    keys, values = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    BatchCache(store, counts=[2, 0]).update(keys, values, 0)
    assert store.lengths == [7, 3]
    assert torch.equal(store.layer(0)[0][0, :, 5:7], keys[0]) and torch.equal(
        store.layer(0)[1][0, :, 5:7], values[0]
    )


def test_a_copied_cache_holds_a_row_s_entries_and_owns_them():
    """copy_cache: a batch row's entries (all of them, at its own length) in a DynamicCache of their own."""
    from transformers.cache_utils import DynamicCache

    layers = [(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for n in (5, 5)]
    prefill, other = DynamicCache(), DynamicCache()
    for index, (keys, values) in enumerate(layers):
        prefill.update(keys, values, index)
        other.update(keys[:, :, :3] + 1, values[:, :, :3] + 1, index)
    store = KVStore(2)
    store.add_row(other)
    row = store.add_row(prefill)
    copy = copy_cache(row)
    assert cache_length(copy) == 5
    for layer, (keys, values) in zip(copy.layers, layers, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    store.groups[0].zero_()  # the store's rows change; the copy does not
    assert torch.equal(copy.layers[0].keys, layers[0][0])
    again = copy_cache(copy)
    copy.layers[0].keys.zero_()
    assert torch.equal(again.layers[0].keys, layers[0][0])  # a dynamic cache's copy is its own too


def test_a_store_of_layers_of_two_shapes_keeps_each_layer_s_entries():
    """Layers of 2 heads of 4 and of 1 head of 8 (Gemma 4's local and global layers) in one store: one tensor per
    shape; a batched forward writes each layer at each row's offset, keeping a path and removing a row move every
    layer's entries, a row copied out has its own layers' entries, and its size counts both shapes."""
    from transformers.cache_utils import DynamicCache

    from vlmspec.cache import BatchCache, cache_nbytes

    shapes = [(2, 4), (1, 8), (2, 4)]
    rows = []
    store = KVStore(max_rows=2)
    for length in (5, 3):
        prefill = DynamicCache()
        layers = [(torch.randn(1, h, length, d), torch.randn(1, h, length, d)) for h, d in shapes]
        for index, (keys, values) in enumerate(layers):
            prefill.update(keys, values, index)
        rows.append((store.add_row(prefill), layers))
    assert [tuple(g.shape[i] for i in (1, 3, 5)) for g in store.groups] == [(2, 2, 4), (1, 1, 8)]
    new = [(torch.randn(2, h, 2, d), torch.randn(2, h, 2, d)) for h, d in shapes]
    batch = BatchCache(store, counts=[2, 2])
    for index, (keys, values) in enumerate(new):
        batch.update(keys, values, index)
    assert store.lengths == [7, 5]
    store.keep_row(0, 5, torch.tensor([6]))  # row 0 keeps its second new entry only
    (first, _), (second, layers) = rows
    store.remove_row(first)  # row 1 moves into row 0
    copy = copy_cache(second)
    assert second.row == 0 and cache_length(copy) == 5
    for index, (keys, _values) in enumerate(layers):
        assert torch.equal(copy.layers[index].keys[0, :, :3], keys[0])
        assert torch.equal(copy.layers[index].keys[0, :, 3:], new[index][0][1])
    assert cache_nbytes(second) == sum(t.nbytes for layer in copy.layers for t in (layer.keys, layer.values))
