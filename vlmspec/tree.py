"""The token tree as explicit data.

A tree holds ``N + 1`` nodes. Node 0 is the *root*: the last token already decided (the target's "bonus"
token of the previous step, or the first token after prefill) which neither the target nor (in general)
the draft has consumed yet. Nodes ``1..N`` are draft candidates. Nodes are stored in topological order
(every parent index is smaller than its child's), which is what level-by-level drafting produces.

Everything the verifier needs derives from ``parents``:

* ``depths``: root 0, child = parent + 1;
* ``ancestors``: ``[N+1, N+1]`` bool, ``ancestors[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``
  (this is also the tree attention pattern: node ``i`` attends to ``j`` iff ``ancestors[i, j]``);
* ``positions(past)``: ``past + depths``: a node sits at the position of the sequence it ends;
* ``attention_bias(past)``: the additive float mask ``[1, 1, N+1, past+N+1]`` (0 where attended,
  ``finfo.min`` elsewhere). A float mask is used because transformers 5.x mis-handles a *bool* 4-D mask
  under eager attention.
* ``retrieve_paths()``: ``[L, D+1]`` the root-to-leaf index paths, padded with -1 (for inspection/plots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self relation of a topologically ordered tree.

    Args:
        parents: ``[N+1]`` long, ``parents[0] == -1`` and ``parents[i] < i`` for ``i >= 1``.

    Returns:
        ``[N+1, N+1]`` bool with ``out[i, j]`` true iff ``j`` is ``i`` or one of its ancestors.
    """
    n = parents.shape[0]
    anc = torch.eye(n, dtype=torch.bool, device=parents.device)
    if n == 1:
        return anc
    # Repeated squaring of the "parent-or-self" relation: after k rounds every row holds all ancestors
    # up to 2^k hops away; ceil(log2(N+1)) rounds cover any depth. No data-dependent host sync.
    reach = anc.clone()
    rows = torch.arange(1, n, device=parents.device)
    reach[rows, parents[1:]] = True
    as_float = reach.to(torch.float32)
    for _ in range((n - 1).bit_length()):
        as_float = (as_float @ as_float).clamp_(max=1.0)
    return as_float.bool()


@dataclass
class TokenTree:
    """A draft token tree.

    Attributes:
        tokens: ``[N+1]`` long, token id of each node (``tokens[0]`` is the root).
        parents: ``[N+1]`` long, parent index (``-1`` for the root).
        draft_probs: ``[N+1]`` float, the draft's probability of each node's token given its parent
            (1.0 for the root). Used by sampling verification and by policies' statistics.
        ancestors: ``[N+1, N+1]`` bool ancestor-or-self matrix (computed from ``parents`` if omitted).
        source_ids: ``[N+1]`` long, the id of each node in the :class:`~vlmspec.draft.DraftTree` it came from
            (``None`` for trees built directly).
        depths: ``[N+1]`` long depth of every node, root 0 (computed from ``ancestors`` if omitted).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor
    ancestors: torch.Tensor | None = None
    source_ids: torch.Tensor | None = None
    depths: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1 or self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"TokenTree: tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} must be "
                "1-D of the same length"
            )
        if self.ancestors is None:
            self.ancestors = ancestor_matrix(self.parents)
        if self.depths is None:
            self.depths = self.ancestors.sum(dim=1) - 1

    @classmethod
    def root_only(cls, token: torch.Tensor) -> TokenTree:
        """A tree holding only the root token (plain autoregressive step)."""
        device = token.device
        return cls(
            tokens=token.reshape(1).long(),
            parents=torch.full(
                (1,), -1, dtype=torch.long, device=device
            ),  # a factory: no host-to-device copy
            draft_probs=torch.ones(1, device=device),
        )

    @property
    def num_nodes(self) -> int:
        """Number of draft nodes, root excluded (``N``)."""
        return self.tokens.shape[0] - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    def positions(self, past: int) -> torch.Tensor:
        """``[N+1]`` logical sequence positions: the root sits at ``past``."""
        return past + self.depths

    def attention_bias(self, past: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive tree attention mask ``[1, 1, N+1, past+N+1]``: prefix fully visible, tree ancestors-only."""
        return tree_attention_bias(self.ancestors, past, dtype)

    def path_to(self, node: int | torch.Tensor) -> torch.Tensor:
        """Indices from the root to ``node`` inclusive, ``[depth+1]`` long (ascending = root first)."""
        return self.ancestors[node].nonzero().flatten()

    def path_first(self, node: torch.Tensor) -> torch.Tensor:
        """``[N+1]`` long: :meth:`path_to` ``(node)`` (its first ``depths[node] + 1`` entries), then every other
        node. A fixed shape, so no host sync: the caller reads the length with whatever else it reads."""
        on_path = self.ancestors[node].to(torch.uint8)  # [N+1]; ancestors precede descendants (topological)
        return on_path.argsort(descending=True, stable=True)

    def retrieve_paths(self) -> torch.Tensor:
        """``[L, D+1]`` root-to-leaf index paths (one per leaf), right-padded with ``-1``."""
        is_parent = torch.zeros_like(self.tokens, dtype=torch.bool)
        is_parent[self.parents[1:]] = True
        leaves = (~is_parent).nonzero().flatten()
        rows = self.ancestors[leaves]  # [L, N+1]
        width = self.max_depth + 1
        order = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
        keyed = torch.where(rows, order, torch.full_like(order, rows.shape[1]))
        paths = keyed.sort(dim=1).values[:, :width]
        return torch.where(paths == rows.shape[1], torch.full_like(paths, -1), paths)


def tree_attention_bias(visible: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask for ``n`` query tokens over ``past`` keys all of them see, then ``m`` keys some of them see.

    Args:
        visible: ``[n, m]`` bool, which of the last ``m`` keys each query may attend to (for ``n`` new tokens
            over themselves, ``m = n``: ancestors-or-self).
        past: number of leading keys visible to every query.
        dtype: dtype of the model's activations.

    Returns:
        ``[1, 1, n, past + m]`` float mask with 0 where attended and ``finfo(dtype).min`` elsewhere.
    """
    n, m = visible.shape
    bias = torch.zeros(n, past + m, dtype=dtype, device=visible.device)
    bias[:, past:].masked_fill_(~visible, torch.finfo(dtype).min)
    return bias[None, None]
