"""``eagle2``: EAGLE-2's dynamic draft tree (Li et al., 2024a), the common reference of C2T, PCT and WETAP.

EAGLE-2 builds its tree in two phases (as C2T section 2.2 and PCT section 4.1 describe it):

1. **Expand** for ``depth`` levels. Level 1 holds the root's ``top_k`` most likely children. At every further
   level, the ``top_k`` nodes of the previous level with the highest *cumulative* probability (product of the
   draft probabilities along the path from the root) are expanded in one batched draft forward, and each
   contributes its ``top_k`` most likely children. Every generated child joins the candidate pool (so a level
   holds up to ``top_k * top_k`` candidates), not only the expanded ones.
2. **Rerank** all candidates by cumulative probability and keep the top ``total_tokens``. A child's cumulative
   probability never exceeds its parent's, so the kept set is a valid (ancestor-closed) subtree.

Defaults and choices:

* ``depth=6, top_k=10``: PCT 4.1 ("a draft tree depth of 6, and select 10 nodes during the expansion phase",
  following the EAGLE-2 paper). ``depth`` counts tree levels (the deepest node sits at depth 6), which is the
  EAGLE reference code's ``depth=5`` plus the level produced by the root's forward.
* ``total_tokens=60``: C2T Appendix A reads EAGLE-2's tree size (60) off its appendix; PCT 4.1 uses 50 in its
  comparison. 60 also keeps the verification budget comparable with the other policies here (the 63-node static
  tree, SAGE's and WETAP's 64).
* Ties in the rerank are broken by depth (shallower first), then node id, so a parent always ranks before its
  children even when a child has probability 1 (its cumulative probability then equals its parent's in float
  arithmetic too: ``fl(c * p) <= c`` for ``p <= 1``). The kept set is therefore always ancestor-closed.
* The frontier is chosen by ``topk`` on the cumulative probabilities of the level just added; equal values are
  resolved by ``torch.topk`` (any choice is lossless).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from ..draft import DraftTree
from ..tree import TokenTree
from .base import PolicyConfig, TreePolicy, check, check_positive_int, is_int, register_policy

MAX_EXPANSION_NODES = 8192
"""The most nodes EAGLE-2's expansion may hold (``depth * top_k**2``): the draft tree keeps an ancestor matrix of
their square (64 MiB at this bound), so ``top_k=100`` would ask for gigabytes."""


@dataclass(frozen=True)
class EAGLE2Config(PolicyConfig):
    """EAGLE-2 hyper-parameters (see the module docstring for where each default comes from).

    Args:
        depth: levels of the expanded tree (6).
        top_k: nodes expanded per level, and children per expanded node (10).
        total_tokens: draft nodes kept after the rerank (60).
    """

    budget_field = "total_tokens"
    depth_field = "depth"

    depth: int = 6
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self) -> None:
        check_positive_int(self, "depth")
        check_positive_int(self, "top_k")
        check_positive_int(self, "total_tokens")  # fmt: skip
        bound = f"the expansion holds depth * top_k^2 candidates, at most {MAX_EXPANSION_NODES}"
        check(self.depth <= MAX_EXPANSION_NODES, self, "depth", self.depth,  # beyond any top_k: the depth's fault
              f"at most {MAX_EXPANSION_NODES} // top_k^2 ({MAX_EXPANSION_NODES // self.top_k**2} with top_k="
              f"{self.top_k}): {bound}")  # fmt: skip
        check(self.depth * self.top_k**2 <= MAX_EXPANSION_NODES, self, "top_k", self.top_k,
              f"at most {self.max_top_k(self.depth)} at depth {self.depth}: {bound} (its ancestor matrix grows with "
              "their square)")  # fmt: skip

    @classmethod
    def implied_options(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The base's, and a ``top_k`` set beyond the default depth's bound lowers that depth to fit it (as a fitted
        depth is kept within the bound: :meth:`budget_options`)."""
        implied, top_k = super().implied_options(values), values.get("top_k")
        if "depth" not in values and is_int(top_k) and top_k >= 1:
            implied["depth"] = max(1, min(cls().depth, MAX_EXPANSION_NODES // top_k**2))
        return implied

    @staticmethod
    def max_top_k(depth: int) -> int:
        return math.isqrt(MAX_EXPANSION_NODES // depth)

    def budget_options(
        self, nodes: int | None = None, depth: int | None = None, fixed: Collection[str] = ()
    ) -> dict[str, Any]:
        """The base's options, the depth kept within the expansion bound for this ``top_k``."""
        if depth is not None:
            depth = max(1, min(depth, MAX_EXPANSION_NODES // self.top_k**2))
        return super().budget_options(nodes, depth, fixed)


Observer = Callable[[torch.Tensor, torch.Tensor], None]


def eagle2_expand(draft: DraftTree, depth: int, top_k: int, observe: Observer | None = None) -> None:
    """EAGLE-2's expansion phase: grow ``draft`` for ``depth`` levels (no rerank).

    Args:
        draft: the step's draft tree (only the root so far).
        depth: levels to grow.
        top_k: nodes expanded per level and children per expanded node.
        observe: optional ``observe(nodes, probs)`` called after every draft forward with the expanded node ids
            ``[F]`` and their next-token distributions ``[F, V]`` (used to record C2T training features).
    """
    frontier = torch.zeros(1, dtype=torch.long, device=draft.tokens.device)  # the root
    probs = draft.next_probs(frontier)  # [1, V]
    for level in range(1, depth + 1):
        if observe is not None:
            observe(frontier, probs)
        k = min(top_k, probs.shape[-1])
        top_p, top_tok = probs.topk(k, dim=-1)  # [F, k]
        parents = frontier[:, None].expand(-1, k)
        ids = draft.add(parents.reshape(-1), top_tok.reshape(-1), top_p.reshape(-1))
        if ids.numel() == 0 or level == depth:
            break
        best = draft.cum_probs[ids].topk(min(top_k, ids.numel())).indices
        frontier = ids[best].sort().values
        probs = draft.next_probs(frontier)  # one batched draft forward for the whole frontier


def top_by_cumulative(draft: DraftTree, n: int) -> torch.Tensor:
    """EAGLE-2's rerank: the root plus the ``n`` nodes of highest cumulative probability.

    Ties: shallower first, then lower id, so the result is ancestor-closed (see the module docstring).

    Returns:
        ``[m+1]`` ascending node ids, root included (``m = min(n, draft.num_nodes)``).
    """
    device = draft.tokens.device
    cum, depth = draft.cum_probs[1:], draft.depths[1:]
    order = depth.sort(stable=True).indices  # by depth, ids ascending within a depth
    order = order[(-cum[order]).sort(stable=True).indices]  # then by cumulative probability, descending
    keep = order[:n] + 1
    return torch.cat([torch.zeros(1, dtype=torch.long, device=device), keep.sort().values])


@register_policy("eagle2")
class EAGLE2Policy(TreePolicy):
    config_class = EAGLE2Config

    def reset(self) -> None:
        self._last: dict[str, Any] = {}

    def build_tree(self, draft: DraftTree) -> TokenTree:
        c = self.config
        eagle2_expand(draft, c.depth, c.top_k)
        candidates = draft.num_nodes
        keep = top_by_cumulative(draft, c.total_tokens)
        self._last = {"candidates": candidates}
        return draft.tree(keep)

    def trace(self) -> dict[str, Any]:
        return dict(self._last)
