"""A synthetic draft model for policy unit tests: chosen next-token distributions, real DraftTree."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmspec.draft import DraftTree
from vlmspec.models import DecodeState


class _CountingCache:
    """Stands in for a KV cache: only its length matters to DraftTree while a tree is grown."""

    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length


class SyntheticDraft:
    """Adapter-like object whose next-token distribution is ``dist_fn(tokens, positions) -> [n, V] probs``."""

    dtype = torch.float32

    def __init__(self, dist_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.dist_fn = dist_fn
        self.calls: list[int] = []  # number of tokens per forward

    def forward(self, state, tokens, positions, bias):
        n = tokens.shape[0]
        assert bias.shape == (1, 1, n, state.cache.length + n)
        state.cache.length += n
        self.calls.append(n)
        return self.dist_fn(tokens, positions).clamp_min(1e-12).log()

    def forward_root(self, state, pending, root, positions, bias):
        """The adapter contract's root forward: the pending tokens, then the root."""
        return self.forward(state, torch.cat([pending, root.reshape(1)]), positions, bias)


def synthetic_tree(
    dist_fn, depth_limit: int = 64, root_position: int = 10
) -> tuple[DraftTree, SyntheticDraft]:
    """A DraftTree over a synthetic draft with an empty cache."""
    adapter = SyntheticDraft(dist_fn)
    state = DecodeState(cache=_CountingCache(), rope_delta=torch.zeros((), dtype=torch.long), visual_tokens=0)
    tree = DraftTree(
        adapter, state, torch.tensor(1), root_position, torch.zeros(0, dtype=torch.long), depth_limit
    )
    return tree, adapter


def peaked(vocab: int, top: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Every node's distribution puts ``top`` on token ``(t + 1) % V`` and spreads the rest uniformly."""

    def fn(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        rest = (1.0 - top) / (vocab - 1)
        probs = torch.full((tokens.shape[0], vocab), rest)
        probs[torch.arange(tokens.shape[0]), (tokens + 1) % vocab] = top
        return probs

    return fn


def geometric(vocab: int, ratio: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Probabilities proportional to ``ratio ** rank`` (rank order shifted by the token id)."""

    def fn(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        base = ratio ** torch.arange(vocab, dtype=torch.float32)
        base = base / base.sum()
        rows = [base.roll(int(t) + 1) for t in tokens]
        return torch.stack(rows)

    return fn


def table(
    rows: dict[int, dict[int, float]], vocab: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A draft whose next-token distribution after token ``t`` is ``rows[t]``, the rest of the mass spread thinly
    over the other tokens (uniform after a token not in ``rows``)."""

    def fn(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        probs = torch.full((tokens.shape[0], vocab), 1e-6)
        for i, t in enumerate(tokens.tolist()):
            for token, p in rows.get(t, {v: 1 / vocab for v in range(vocab)}).items():
                probs[i, token] = p
        return probs / probs.sum(-1, keepdim=True)

    return fn
