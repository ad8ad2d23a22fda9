"""Acceptance rules as pure functions of (tree, target logits).

Greedy rule (lossless for greedy decoding). Let ``g = argmax_v p_target(v | prefix, path(i))`` be the
target's choice after every tree node ``i`` (one verification forward gives all of them). A non-root node
``j`` is *correct* iff ``tokens[j] == g[parent(j)]``: it is exactly what the target would have produced next.
A node is *accepted* iff it and all its ancestors are correct. The deepest accepted node ``a`` ends the
accepted path and ``g[a]`` (the "bonus" token) follows it, so the step emits ``depth(a) + 1`` tokens that are,
by induction, the target's own greedy continuation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sampling import draw
from .tree import TokenTree


@dataclass
class Acceptance:
    """Outcome of verifying one tree, in fixed-shape device tensors (no host sync until the engine reads it).

    Attributes:
        last: ``[]`` long, tree index of the last accepted node (the root when no draft node was accepted).
        order: ``[N+1]`` long, the accepted path's tree indices from the root (its first ``length`` entries),
            then the other nodes (see :meth:`~vlmspec.tree.TokenTree.path_first`).
        length: ``[]`` long, nodes on the accepted path, root included (``a + 1``).
        next_token: ``[]`` long, the target's token after the path (the bonus token).
    """

    last: torch.Tensor
    order: torch.Tensor
    length: torch.Tensor
    next_token: torch.Tensor

    @classmethod
    def at(cls, tree: TokenTree, node: torch.Tensor, next_token: torch.Tensor) -> Acceptance:
        """The path from the root to ``node`` ``[]``, followed by ``next_token``."""
        return cls(
            last=node, order=tree.path_first(node), length=tree.depths[node] + 1, next_token=next_token
        )

    @property
    def path(self) -> torch.Tensor:
        """``[a+1]`` long, tree indices from the root to the last accepted node (reads ``length``: a host sync)."""
        return self.order[: int(self.length)]

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root excluded): tau for this step (a host sync)."""
        return int(self.length) - 1


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
    function does, for all nodes at once (one draw over ``[N+1, V]``, no per-child host sync), and then walks
    the tree as the greedy rule does with ``y`` in place of the argmax. Only the samples along the accepted path
    are used, each once, so drawing the others changes nothing.

    Args:
        tree: the verified tree with ``N + 1`` nodes.
        target_probs: ``[N+1, V]`` the target's warped next-token distributions at every node.
        generator: the sampling generator (seeded runs repeat exactly).
    """
    choice = draw(target_probs, generator).squeeze(1)  # y: [N+1]
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
    return Acceptance.at(tree, best, choice[best])


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
        root = torch.zeros((), dtype=torch.long, device=tree.tokens.device)
        return Acceptance.at(tree, root, choice[0])
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
    accepted = cum_ratio >= math.log(tau)
    accepted[0] = False
    deepest = depth.masked_fill(~accepted, -1).max()  # the deepest layer with an acceptance (-1: none)
    candidates = accepted & (depth == deepest)
    # first max: lowest index on ties; with no acceptance every entry is -inf and the root (0) is chosen
    best = cum_draft.masked_fill(~candidates, float("-inf")).argmax()
    return Acceptance.at(tree, best, choice[best])


# ---- DSBD: speculative beam sampling (shared/papers/dsbd.txt, sections 3.1-3.2, Algorithm 1) ------------------
#
# One layer of a draft forest is verified over a finite *candidate space*: the pairs (b, x) of an input beam b
# of the layer and a next token x, flattened to ``b * V + x``. ``p_beam`` and ``q_beam`` are the target's and
# the draft's beam-level distributions over it (Eq. 1); the draft beams of the layer are i.i.d. draws from
# ``q_beam``. The functions below are pure (randomness only through the generator passed in).

_RESIDUAL_EPS = 1e-12


def beam_distribution(beam_weights: torch.Tensor, next_probs: torch.Tensor) -> torch.Tensor:
    """The beam-level sampling distribution of one layer (dsbd.txt Eq. 1; ``p_beam``/``q_beam`` of section 3.1).

    ``beam(b, x) = w_b * P(x | b) / sum_{b'} w_{b'}``: the joint probability of beam ``b`` extended by token ``x``
    (the beam's probability times its next-token distribution), normalised over every candidate ``(b', x')`` of
    the layer. Every row of ``next_probs`` sums to one, so the normaliser is ``sum_b w_b``.

    Args:
        beam_weights: ``[B]`` non-negative beam probabilities on any common scale, not all zero.
        next_probs: ``[B, V]`` next-token distributions of the beams (already warped: top-k/top-p).

    Returns:
        ``[B * V]`` float64 probabilities; candidate ``(b, x)`` is entry ``b * V + x``.
    """
    joint = beam_weights.double()[:, None] * next_probs.double()  # [B, V]
    total = joint.sum()
    if not bool(total > 0):
        raise ValueError("beam_distribution: the beams carry no probability mass")
    return (joint / total).flatten()


def _beam_accept_prob(residual: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``min(1, p'(x) / q(x))`` for a drafted candidate ``x`` (``q(x) > 0``: ``x`` was drawn from ``q``)."""
    return (residual / q).clamp(max=1.0)


def _beam_residual(residual: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p' - q))``: the residual after a rejection.

    When nothing is left (``p' <= q`` everywhere, so ``p' == q`` and the rejection had probability 0; only
    floating-point noise gets here) ``p'`` is returned unchanged rather than normalising noise.
    """
    rest = (residual - q).clamp_min(0.0)
    mass = rest.sum()
    if float(mass) <= _RESIDUAL_EPS:
        return residual
    return rest / mass


def beam_acceptance_probs(p_beam: torch.Tensor, q_beam: torch.Tensor, m: int) -> torch.Tensor:
    """``alpha_1 .. alpha_m`` (dsbd.txt Eq. 4): the probability that the ``j``-th draft beam is accepted given that
    the ``j - 1`` before it (since the last acceptance) were rejected::

        alpha_j = sum_x q(x) min(1, p_j(x) / q(x)) = sum_x min(p_j(x), q(x))
        p_1 = p_beam,   p_{j+1} = norm(max(0, p_j - q_beam))

    Args:
        p_beam, q_beam: ``[K]`` target and draft beam-level distributions over the layer's candidates.
        m: number of draft beams verified at the layer.

    Returns:
        ``[m]`` float64.
    """
    p, q = p_beam.double(), q_beam.double()
    alphas = []
    for _ in range(m):
        alphas.append(torch.minimum(p, q).sum())
        p = _beam_residual(p, q)
    if not alphas:
        return torch.zeros(0, dtype=torch.float64, device=p.device)
    return torch.stack(alphas)


def accepted_count_probs(alphas: torch.Tensor | list[float]) -> torch.Tensor:
    """``P(m, k)``, the probability that exactly ``k`` of ``m`` draft beams are accepted (dsbd.txt Eq. 2-3).

    ``P~(i) = alpha_i prod_{j<i} (1 - alpha_j)`` is the probability that the ``i``-th beam is the first accepted
    one (after an acceptance ``p'`` is reset to ``p_beam``, so the alphas start again from ``alpha_1``)::

        P(n, k) = sum_{i=1}^{n} P~(i) P(n - i, k - 1)   (k >= 1)
        P(n, 0) = prod_{j=1}^{n} (1 - alpha_j),   P(0, 0) = 1,   P(n, k) = 0 for k > n

    Args:
        alphas: ``[m]`` the acceptance probabilities of :func:`beam_acceptance_probs`.

    Returns:
        ``[m + 1]`` float64, entry ``k`` is ``P(m, k)``.
    """
    a = [float(x) for x in (alphas.tolist() if torch.is_tensor(alphas) else alphas)]
    m = len(a)
    first = [0.0] * (m + 1)  # first[i] = P~(i), 1-based
    none = [1.0] * (m + 1)  # none[n] = prod_{j<=n} (1 - alpha_j)
    for i in range(1, m + 1):
        first[i] = a[i - 1] * none[i - 1]
        none[i] = none[i - 1] * (1.0 - a[i - 1])
    table = [[0.0] * (m + 1) for _ in range(m + 1)]
    for n in range(m + 1):
        table[n][0] = none[n]
        for k in range(1, n + 1):
            table[n][k] = sum(first[i] * table[n - i][k - 1] for i in range(1, n + 1))
    return torch.tensor(table[m], dtype=torch.float64)


def dynamic_width(alphas: torch.Tensor | list[float], threshold: float, w_min: int) -> int:
    """The layer's target width ``W_L = max(W_min, W~_L(t))`` (dsbd.txt Eq. 5-7).

    ``W~_L(t) = max{K : 1 - sum_{k=0}^{K-1} P(M, k) >= t}``: the largest ``K`` such that at least ``K`` of the
    ``M = len(alphas)`` draft beams are accepted with probability ``>= t`` (``K = 0`` always qualifies).
    Eq. 5 starts the sum at ``k = 1``; Eq. 7's ``k = 0`` is the probability of "at least K", so it is used.
    ``>= t`` is tested with a 1e-9 tolerance so that a certain acceptance (all alphas 1) passes ``t = 1``.

    Args:
        alphas: ``[M]`` acceptance probabilities (Eq. 4).
        threshold: ``t`` in ``[0, 1]``.
        w_min: ``W_min >= 1``.
    """
    probs = accepted_count_probs(alphas).tolist()
    at_least, width = 1.0, 0
    for k in range(1, len(probs)):
        at_least -= probs[k - 1]  # P(at least k accepted)
        if at_least < threshold - 1e-9:
            break
        width = k
    return max(w_min, width)


@dataclass
class BeamLayer:
    """Outcome of verifying one DSBD layer (:func:`verify_beam_layer`).

    Attributes:
        outputs: ``[W]`` long candidate indices of the layer's output beams, in order: the accepted draft beams,
            then (when fewer than ``W`` were accepted) one draw from the residual ``p'``, then draws from
            ``p_beam`` up to ``W``.
        accepted: ``[a]`` long positions in ``draws`` of the accepted draft beams (``a <= W``).
        complete: ``a == W``: the layer is accepted and verification moves on to the next one.
    """

    outputs: torch.Tensor
    accepted: torch.Tensor
    complete: bool


def verify_beam_layer(
    p_beam: torch.Tensor,
    q_beam: torch.Tensor,
    draws: torch.Tensor,
    width: int,
    generator: torch.Generator,
) -> BeamLayer:
    """Verify one layer of draft beams (dsbd.txt Algorithm 1, lines 12-30): output ``width`` beams i.i.d. ``p_beam``.

    The draft beams ``draws`` are i.i.d. ``q_beam``. They are tried in order::

        p' <- p_beam
        for each draft beam x (until `width` are accepted):
            accept x with probability min(1, p'(x) / q(x));  on acceptance  p' <- p_beam
            else                                             p' <- norm(max(0, p' - q))
        if fewer than `width` were accepted:  one beam ~ p',  then beams ~ p_beam up to `width`

    Ratio direction: Algorithm 1's line 16 (and the text of section 3.1) write ``q / p'``; the proof of
    Theorem 3.1 (Appendix A, Eq. 13 and 15) uses ``min(1, p' / q)``, which is the one that makes the theorem
    hold, so it is used. Why it holds: with ``x ~ q``, ``P(accept and output x) = q(x) min(1, p'(x)/q(x)) =
    min(p'(x), q(x))`` and ``P(reject) = 1 - alpha`` with ``alpha = sum min(p', q)``; the rejected mass is
    ``p' - min(p', q) = max(0, p' - q) = (1 - alpha) * norm(max(0, p' - q))``, which is exactly what the next
    round (or the final draw from the residual) emits with probability ``(1 - alpha)`` times its own law. By
    induction over the remaining draft beams, ``P(output = x) = min(p', q)(x) + max(0, p' - q)(x) = p'(x)`` at
    every round, so the first output beam is ``p_beam``-distributed; after an acceptance ``p'`` is reset and the
    unverified draft beams are independent of the past, so the next output beam is a fresh ``p_beam`` draw
    (Theorem 3.1: the output beams are i.i.d. ``p_beam``). With ``q / p'`` instead,
    ``P(accept and output x) = min(q, q^2 / p')`` and the law is wrong.

    Args:
        p_beam: ``[K]`` the target's beam-level distribution over the layer's candidates.
        q_beam: ``[K]`` the draft's beam-level distribution the draws come from.
        draws: ``[m]`` long candidate indices (i.i.d. ``q_beam``; ``m`` may be 0).
        width: ``W_L >= 1``, output beams wanted.
        generator: the sampling generator (on the device of ``p_beam``).
    """
    if width < 1:
        raise ValueError(f"verify_beam_layer: width={width} must be >= 1")
    p_beam, q = p_beam.double(), q_beam.double()
    device = p_beam.device
    residual = p_beam
    outputs: list[int] = []
    accepted: list[int] = []
    for i, x in enumerate(draws.tolist()):
        if len(accepted) == width:  # lines 22-24: the remaining draft beams are rejected
            break
        r = torch.rand((), dtype=torch.float64, generator=generator, device=device)
        if bool(r < _beam_accept_prob(residual[x], q[x])):
            accepted.append(i)
            outputs.append(x)
            residual = p_beam
        else:
            residual = _beam_residual(residual, q)
    complete = len(accepted) == width
    if not complete:  # lines 25-28
        outputs.append(int(draw(residual, generator)))
        rest = width - len(outputs)
        if rest > 0:
            outputs.extend(draw(p_beam, generator, rest).tolist())
    return BeamLayer(
        outputs=torch.tensor(outputs, dtype=torch.long, device=device),
        accepted=torch.tensor(accepted, dtype=torch.long, device=device),
        complete=complete,
    )
