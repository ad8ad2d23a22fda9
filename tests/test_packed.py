"""Packed batched forwards (``vlmspec.models.packed``): the requests' tokens side by side in one sequence, attention
per request over its own cache row, every reply as the padded forward gives it."""

from __future__ import annotations

import pytest
import torch
from test_batching import mixed_requests, reference

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.batching import PackedRows
from vlmspec.models import VLMAdapter
from vlmspec.testing import build_tiny_pair


def test_packed_rows_place_each_token_in_its_row():
    packed = PackedRows.of([2, 0, 3], torch.device("cpu"))
    assert packed.rows.tolist() == [0, 0, 2, 2, 2] and packed.cols.tolist() == [0, 1, 0, 1, 2]
    assert (packed.batch, packed.width) == (3, 3)
    tokens = torch.arange(10.0).reshape(5, 2)  # [M, D]
    padded = packed.pad(tokens)  # [B, n, D]
    assert padded.shape == (3, 3, 2) and padded[1].eq(0).all() and padded[0, 2].eq(0).all()
    assert padded[2].tolist() == tokens[2:].tolist()
    assert torch.equal(packed.unpad(padded), tokens)


def _packing_spy(monkeypatch) -> list[list[int]]:
    """The token counts of every packed forward from now on."""
    calls: list[list[int]] = []
    original = PackedRows.of

    def of(counts, device):
        calls.append(list(counts))
        return original(counts, device)

    monkeypatch.setattr(PackedRows, "of", staticmethod(of))
    return calls


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_a_packed_batch_gives_the_padded_batch_s_replies_and_generate_s(tiny_root, monkeypatch, family):
    """SAGE at batch 4 grows trees of different sizes (packed, a confident request's tree is priced as its own
    tokens): the forwards run packed, on fewer tokens than padded, and every reply is the padded run's and
    ``generate()``'s, token for token."""
    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    assert pipe.target_adapter.packs_rows and pipe.draft_adapter.packs_rows
    requests = mixed_requests()
    pipe.policy = get_policy("sage")
    packed_counts = _packing_spy(monkeypatch)
    packed = [out.token_ids for out in pipe.batch(requests, batch_size=4)]
    assert packed_counts, "no forward ran packed"
    assert sum(map(sum, packed_counts)) < sum(max(c) * len(c) for c in packed_counts)
    monkeypatch.setattr(VLMAdapter, "packs_rows", property(lambda self: False))
    padded = [out.token_ids for out in pipe.batch(requests, batch_size=4)]
    assert packed == padded == [reference(pipe, request) for request in requests]


@pytest.mark.parametrize(("family", "packs"), [("qwen3_vl", True), ("gemma3", False), ("qwen3_5", False)])
def test_only_adapters_with_the_model_s_own_call_pack(tiny_root, family, packs):
    """Gemma 3 passes a mask per layer type and Qwen3.5's decoder is written out (recurrent layers): their batches
    stay padded; a model under eager attention too."""
    pair = build_tiny_pair(family, root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    assert pipe.target_adapter.packs_rows is packs
    eager = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="ar", torch_dtype=torch.float32, attn_implementation="eager"
    )
    assert not eager.target_adapter.packs_rows
