"""Packed batched forwards: the requests' tokens side by side in one sequence, with no padding.

A batched forward of ``B`` requests with ``n_b`` tokens each, padded, runs ``B * max(n_b)`` tokens through every
linear layer; packed, ``sum(n_b)``. Trees differ in size from request to request (SAGE's growth by cost keeps a
tree as large as its draft is confident; a request that drafts no deeper level sits out the draft's forward), and
where tokens cost compute (a CPU, a GPU at a large batch) the padding is paid for in full: at 24 requests with
trees of 0 to 6 nodes, padding to the largest runs three times the tokens.

Only attention mixes tokens, so only attention sees the batch's shape: each request's queries attend to its own
cache row under its own tree mask. A registered attention function (transformers' ``AttentionInterface``, the
public way to add one) takes the packed queries ``[1, H, M, D]``, scatters them into ``[B, H, n, D]``, runs
transformers' SDPA attention over the cache's rows ``[B, H, keys, D]`` under the ``[B, 1, n, keys]`` mask exactly as
a padded forward does, and gathers the ``M`` outputs back. The cache writes each packed token into its own row
(:class:`~vlmspec.cache.BatchCache`). The decoder is switched to that function for the one forward, under the
model's lock (:func:`~vlmspec.models.attention.model_lock`), and back, as the pruning probe switches to eager.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_ATTENTION = "vlmspec_packed_sdpa"
"""The registered name of the packed attention function (over transformers' ``"sdpa"``)."""


@dataclass(frozen=True)
class PackedRows:
    """Where each of a packed forward's ``M`` tokens sits in the padded ``[B, n]`` batch.

    Attributes:
        rows: ``[M]`` long, the request row of each token.
        cols: ``[M]`` long, its place among that request's tokens.
        batch: ``B``, the store's rows (a row with no token takes no part but keeps its place).
        width: ``n``, the most tokens of any request.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    batch: int
    width: int

    @classmethod
    def of(cls, counts: Sequence[int], device: torch.device) -> PackedRows:
        """The layout of rows holding ``counts[b]`` tokens each, packed in row order."""
        sizes = torch.tensor(counts)
        rows = torch.repeat_interleave(torch.arange(len(counts)), sizes)  # [M]
        starts = torch.cumsum(sizes, 0) - sizes  # [B]
        cols = torch.arange(rows.shape[0]) - starts[rows]  # [M]
        return cls(rows.to(device), cols.to(device), len(counts), max(counts))

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """``[M, ...]`` -> ``[B, n, ...]`` (zeros where a row has fewer tokens)."""
        padded = packed.new_zeros(self.batch, self.width, *packed.shape[1:])
        padded[self.rows, self.cols] = packed
        return padded

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, n, ...]`` -> ``[M, ...]``."""
        return padded[self.rows, self.cols]


def _packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    vlmspec_rows: PackedRows | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; with ``vlmspec_rows``, over packed queries ``[1, H, M, D]`` and the cache's
    rows ``[B, H, keys, D]``: returns ``[1, M, H, D]`` (an attention function's output layout)."""
    if vlmspec_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    padded = vlmspec_rows.pad(query[0].transpose(0, 1)).transpose(1, 2)  # [M, H, D] -> [B, H, n, D]
    out, _ = sdpa_attention_forward(module, padded, key, value, attention_mask, **kwargs)  # [B, n, H, D]
    return vlmspec_rows.unpad(out)[None], None


AttentionInterface.register(PACKED_ATTENTION, _packed_sdpa)


def packs_under(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder``'s forwards can run packed: its attention is transformers' SDPA."""
    return decoder.config._attn_implementation == "sdpa"


@contextmanager
def packed_attention(model: torch.nn.Module, packed: PackedRows | None) -> Iterator[dict[str, Any]]:
    """The block's forward of ``model`` runs packed as ``packed`` lays it out (``None``: as it is); yields the
    keyword arguments the model's forward passes on to its attention. Hold the model's lock around it."""
    if packed is None:
        yield {}
        return
    decoder = model.get_decoder()
    decoder.set_attn_implementation(PACKED_ATTENTION)
    try:
        yield {"vlmspec_rows": packed}
    finally:
        decoder.set_attn_implementation("sdpa")
