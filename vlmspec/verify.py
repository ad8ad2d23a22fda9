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
    return accept_choices(tree, target_logits.argmax(dim=-1))


def sample_accept(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Lossless tree speculative sampling (multi-candidate rejection) for deterministically picked children.

    The rule at a node ``u`` whose children ``c_1..c_m`` (distinct tokens, picked deterministically: top-k,
    static ranks, ...) are tried in order, with ``p`` the target's warped distribution at ``u``:

        p' <- p
        for i in 1..m:   accept c_i with probability min(1, p'(c_i) / 1) = p'(c_i)   (a deterministic pick has
                         draft probability 1, so the ratio is taken to 1); on acceptance move to c_i
                         else p'(c_i) <- 0; p' <- p' / sum(p')                        (residual update)
        if none accepted: draw the next token from the residual p'

    Why it is unbiased: ``P(emit c_1) = p(c_1)``; ``P(emit c_2) = (1 - p(c_1)) * p(c_2) / (1 - p(c_1)) = p(c_2)``;
    and so on; a token ``y`` outside the children is emitted with ``(1 - sum_i p(c_i)) * p(y) / (1 - sum_i
    p(c_i)) = p(y)``. So the emitted token is distributed exactly as ``p`` at every node, whatever the tree, and by
    induction along the path the whole output follows the target's own sampling distribution.

    The same law is obtained by drawing ONE token ``y_u ~ p_u`` and accepting the child whose token is ``y_u`` (if
    any, else emitting ``y_u``): each branch above has exactly the probability ``p_u(token)``. That is what this
    function does, for all nodes at once (one multinomial over ``[N+1, V]``, no per-child host sync), and then walks
    the tree as the greedy rule does with ``y`` in place of the argmax. Only the samples along the accepted path
    are used, each once, so drawing the others changes nothing.

    Args:
        tree: the verified tree with ``N + 1`` nodes.
        target_probs: ``[N+1, V]`` the target's warped next-token distributions at every node.
        generator: the sampling generator (seeded runs repeat exactly).
    """
    choice = torch.multinomial(target_probs, 1, generator=generator).squeeze(1)  # y: [N+1]
    return accept_choices(tree, choice)


def accept_choices(tree: TokenTree, choice: torch.Tensor) -> Acceptance:
    """Walk the tree following the target's choices.

    Args:
        tree: the verified tree with ``N + 1`` nodes.
        choice: ``[N+1]`` the target's next token after every node (argmax, or a sample).

    Returns:
        The deepest path whose every node is the target's choice after its parent, and the choice after it.
    """
    correct = torch.ones_like(tree.tokens, dtype=torch.bool)
    correct[1:] = tree.tokens[1:] == choice[tree.parents[1:]]  # [N+1]
    # accepted[i] = all(correct[j] for j in ancestors(i)): no ancestor-or-self that is incorrect.
    accepted = ~(tree.ancestors & ~correct[None, :]).any(dim=1)  # [N+1]
    depth = tree.depths
    score = torch.where(accepted, depth, torch.full_like(depth, -1))
    best = score.argmax()  # deepest accepted node (the root always qualifies)
    return Acceptance(path=tree.path_to(best), next_token=choice[best])


def beam_accept(tree: TokenTree, target_logits: torch.Tensor, tau: float) -> Acceptance:
    """WETAP's beam-level acceptance (wetap.txt Eq. 9, Algorithm 1 lines 27-51). **Lossy**: changes the output.

    A node ``v`` is accepted when the cumulative ratio of target to draft probabilities along its beam (the path
    from the root to ``v``, ``v`` included) reaches ``tau``::

        prod_{u in path(v)} p_target(u) / q_draft(u) >= tau

    where ``p_target(u) = softmax(target_logits[parent(u)])[token(u)]`` and ``q_draft(u)`` is the draft
    probability the tree was built with (``tree.draft_probs``). Unlike :func:`greedy_accept`, a beam can be
    accepted although some of its tokens differ from the target's argmax. The tree is verified from the deepest
    layer to the shallowest and verification stops at the first layer holding an accepted node; among that
    layer's accepted nodes the one with the highest cumulative *draft* probability (Eq. 2, the quantity WETAP
    ranks beams by) is chosen, ties to the lowest index. The bonus token is the target's argmax after it (greedy
    counterpart of Algorithm 1's ``t ~ p'``). With no accepted node the step falls back to the root alone and the
    target's own next token.

    Choices: ``>= tau`` as in Eq. 9 (Algorithm 1 writes ``min(1, p/q) > tau``; they differ only at equality and
    for ``tau > 1``, which the WETAP config rejects). Products are summed in log space in float64 so deep beams do
    not underflow.

    Args:
        tree: the verified tree, ``N + 1`` nodes.
        target_logits: ``[N+1, V]`` target logits at every node.
        tau: acceptance threshold on the cumulative ratio, ``> 0``.

    Returns:
        The accepted path (root to the chosen node) and the target's next token after it.
    """
    choice = target_logits.argmax(dim=-1)  # [N+1]
    if tree.num_nodes == 0:
        root = torch.zeros(1, dtype=torch.long, device=tree.tokens.device)
        return Acceptance(path=root, next_token=choice[0])
    log_target = torch.log_softmax(target_logits.double(), dim=-1)  # [N+1, V]
    parents, tokens = tree.parents[1:], tree.tokens[1:]
    log_ratio = torch.zeros(tree.tokens.shape[0], dtype=torch.float64, device=tree.tokens.device)
    log_draft = torch.zeros_like(log_ratio)
    log_draft[1:] = tree.draft_probs[1:].double().clamp_min(1e-300).log()
    log_ratio[1:] = log_target[parents, tokens] - log_draft[1:]
    anc = tree.ancestors.double()  # [N+1, N+1] ancestor-or-self
    cum_ratio = anc @ log_ratio  # [N+1] log prod over the beam
    cum_draft = anc @ log_draft  # [N+1] log cumulative draft probability
    depth = tree.depths
    accepted = cum_ratio >= torch.log(torch.tensor(float(tau), dtype=torch.float64, device=cum_ratio.device))
    accepted[0] = False
    if not bool(accepted.any()):
        best = torch.zeros((), dtype=torch.long, device=depth.device)
    else:
        deepest = depth.masked_fill(~accepted, -1).max()  # the deepest layer with an acceptance
        candidates = accepted & (depth == deepest)
        best = cum_draft.masked_fill(~candidates, float("-inf")).argmax()  # first max: lowest index on ties
    return Acceptance(path=tree.path_to(best), next_token=choice[best])
