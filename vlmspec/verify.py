"""Acceptance rules as pure functions of (tree, target logits).

Greedy rule (lossless for greedy decoding). Let ``g = argmax_v p_target(v | prefix, path(i))`` be the
target's choice after every tree node ``i`` (one verification forward gives all of them). A non-root node
``j`` is *correct* iff ``tokens[j] == g[parent(j)]``: it is exactly what the target would have produced next.
A node is *accepted* iff it and all its ancestors are correct. The deepest accepted node ``a`` ends the
accepted path and ``g[a]`` (the "bonus" token) follows it, so the step emits ``depth(a) + 1`` tokens that are,
by induction, the target's own greedy continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TokenTree


@dataclass
class Acceptance:
    """Outcome of verifying one tree.

    Attributes:
        path: ``[a+1]`` long, tree indices from the root to the last accepted node.
        next_token: ``[]`` long, the target's token after the path (the bonus token).
    """

    path: torch.Tensor
    next_token: torch.Tensor

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root excluded): tau for this step."""
        return self.path.shape[0] - 1


def greedy_accept(tree: TokenTree, target_logits: torch.Tensor) -> Acceptance:
    """Longest root-to-node path that matches the target's argmax, plus the target's next token.

    Args:
        tree: the verified tree with ``N + 1`` nodes.
        target_logits: ``[N+1, V]`` target logits at every tree node.

    Returns:
        The accepted path and bonus token.
    """
    choice = target_logits.argmax(dim=-1)  # g: [N+1]
    correct = torch.ones_like(tree.tokens, dtype=torch.bool)
    correct[1:] = tree.tokens[1:] == choice[tree.parents[1:]]  # [N+1]
    # accepted[i] = all(correct[j] for j in ancestors(i)): no ancestor-or-self that is incorrect.
    accepted = ~(tree.ancestors & ~correct[None, :]).any(dim=1)  # [N+1]
    depth = tree.depths
    score = torch.where(accepted, depth, torch.full_like(depth, -1))
    best = score.argmax()  # deepest accepted node (the root always qualifies)
    return Acceptance(path=tree.path_to(best), next_token=choice[best])
