"""``wetap``: Width-Entropy Tree and Adaptive Pruning (WETAP, ``shared/papers/wetap.txt``).

Per step (section 3.2, Algorithm 1):

1. **Dynamic-width tree of length L.** Layer 1 has width ``W_1 = W_min``. The width of layer ``t + 1`` comes from
   the entropy of layer ``t`` (Eq. 3-6)::

       p'_i = p_i / sum_{j <= W_t} p_j                 H_t = -sum_i p'_i log p'_i
       H_t^norm = min(1, max(0, H_t / log W_t))        W_{t+1} = W_min + (W_max - W_min) * (H_t^norm)^gamma

   Layer ``t + 1`` holds the ``W_{t+1}`` candidates of highest cumulative probability (Eq. 2: product of the
   draft probabilities along the beam) among the children of layer ``t``; each parent proposes the tokens of its
   draft distribution that survive top-K and top-P filtering (Appendix B.4: K 10, P 0.9). All nodes of a layer
   are expanded in one batched draft forward.

2. **Pruning by probability and length** when the tree holds more than ``B`` draft nodes (Eq. 7-8)::

       p_v^norm = (p_v - p_min) / (p_max - p_min + eps)      l_v = d_v / L
       Score_v  = alpha * p_v^norm + (1 - alpha) * l_v

   The ``B`` best-scoring nodes are kept, their missing ancestors are re-added, and if that exceeds ``B`` again,
   leaves are discarded from shallow to deep layers and then the lowest-probability nodes until ``B`` remain
   (section 3.2.2, Appendix D; see :func:`wetap_prune`).

3. **Verification**: the engine's lossless greedy rule by default. ``acceptance="wetap_beam"`` selects WETAP's own
   deep-to-shallow beam verification (Eq. 9, Algorithm 1; :func:`vlmspec.verify.beam_accept`): it changes the
   output, warns when turned on, and the policy then reports ``lossless = False``.

Defaults (Appendix B.4 and sections 4.4.x): ``B = 64``, ``L = 8``, ``W in [16, 128]``, ``gamma = 1.2``,
``alpha = 0.6``, top-K 10, top-P 0.9.

Choices where the paper is open (and why):

* ``p_i`` in Eq. 3-4 and ``p_v`` in Eq. 7 are **cumulative** probabilities of the layer's beams. The layer's
  tokens come from different parents' distributions (the reason Eq. 3 renormalises), they are selected by
  cumulative probability, and Algorithm 1 uses the same ``q_i`` (the beam probabilities returned by
  ``BeamSample``) for the entropy (line 14-15) and for the pruning score (line 21).
* ``W_t`` in Eq. 3-6 is the number of tokens the layer actually holds (fewer than planned when the filtered
  candidates run out, e.g. the root proposes at most top-K = 10 < W_min = 16 children). A layer of one token has
  ``H^norm = 0`` (``log 1 = 0``; its mass is fully concentrated).
* ``W_{t+1}`` is rounded half-up to an integer.
* Top-K / top-P filter each parent's raw draft distribution: the top-K tokens, of which the smallest prefix whose
  probability mass reaches ``top_p`` (the token crossing ``top_p`` included, so at least one token always
  survives). The kept probabilities are not renormalised, so cumulative probabilities stay the draft's.
* Eq. 7's ``p_min`` / ``p_max`` are over all draft nodes of the tree (root excluded); ``eps = 1e-6``.
  ``d_v / L`` uses the configured length ``L``. Score ties prefer the higher cumulative probability, then the
  lower node id.
* Re-pruning after the ancestor repair (Appendix D): first the tree's leaves that are shallower than its deepest
  layer, shallowest first (lowest cumulative probability first within a layer), one pass over the leaves of the
  repaired tree; then, while still over budget, the leaf of lowest cumulative probability (the lowest-probability
  node that can go without orphaning a kept node; ties: deeper, then higher id). In Appendix D the leaf pass
  removes only token 12 although more than one token is over budget and the deepest layer's tokens 15, 16 then
  go by probability, which is only consistent with the leaf pass skipping the deepest layer's leaves.
* Layer 1 expands the root: ``W_1 = W_min`` caps it (Algorithm 1 line 7); the root's own distribution is not
  counted as a layer for the entropy.
* ``tau`` (beam acceptance only, not given in the paper) defaults to 0.5: a beam is accepted when the stochastic
  speculative-sampling rule ``min(1, p/q)`` would accept it at least half of the time, the deterministic (median)
  counterpart of that rule; ``tau = 1`` accepts only beams the target rates at least as high as the draft.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..draft import DraftTree
from ..errors import user_stacklevel
from ..sampling import Sampler
from ..tree import TokenTree
from ..verify import Acceptance, beam_accept
from .base import PolicyConfig, TreePolicy, check, check_positive_int, is_int, register_policy

ACCEPTANCE_RULES = ("greedy", "wetap_beam")


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def normalized_entropy(probs: torch.Tensor) -> float:
    """``H_t^norm`` of one layer (Eq. 3, 4, 6).

    Args:
        probs: ``[W_t]`` the (cumulative) probabilities of the layer's tokens.

    Returns:
        The PI-normalised entropy divided by ``log W_t``, clamped to ``[0, 1]``; 0 for a single token.
    """
    width = probs.shape[0]
    if width <= 1:
        return 0.0
    p = probs.double()
    p = p / p.sum().clamp_min(1e-300)  # Eq. 3
    entropy = float(-(p * p.clamp_min(1e-300).log()).sum())  # Eq. 4
    return min(1.0, max(0.0, entropy / math.log(width)))  # Eq. 6


def filter_top_k_top_p(
    probs: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's top-K tokens, then its smallest prefix reaching mass ``top_p`` (crossing token included).

    Args:
        probs: ``[F, V]`` draft distributions.

    Returns:
        ``top_p [F, k]`` probabilities, ``top_tok [F, k]`` tokens, ``ok [F, k]`` bool (kept after top-P).
    """
    k = min(top_k, probs.shape[-1])
    values, tokens = probs.topk(k, dim=-1)
    before = values.cumsum(dim=-1) - values  # mass of the higher-ranked tokens
    return values, tokens, before < top_p


def wetap_prune(
    parents: torch.Tensor,
    depths: torch.Tensor,
    cum_probs: torch.Tensor,
    budget: int,
    alpha: float,
    length: int,
    eps: float = 1e-6,
) -> torch.Tensor:
    """WETAP's pruning (Eq. 7-8, section 3.2.2, Appendix D) of a tree to at most ``budget`` draft nodes.

    Args:
        parents: ``[N+1]`` long, ``parents[0] == -1`` and ``parents[i] < i``.
        depths: ``[N+1]`` long node depths (root 0).
        cum_probs: ``[N+1]`` cumulative draft probabilities (root 1).
        budget: ``B``, most draft nodes kept (root excluded).
        alpha: weight of the normalised probability in the score.
        length: ``L``, the tree length normalising depths.
        eps: Eq. 7's constant.

    Returns:
        ``[m+1]`` ascending ids of the kept nodes, root first; ancestor-closed, ``m <= budget``.
    """
    n = parents.shape[0] - 1
    device = parents.device
    if n <= budget:
        return torch.arange(n + 1, device=device)
    par = parents.tolist()
    dep = depths.tolist()
    cum = cum_probs.double().tolist()
    c = cum_probs[1:].double()
    p_norm = (c - c.min()) / (c.max() - c.min() + eps)  # Eq. 7
    score = alpha * p_norm + (1 - alpha) * depths[1:].double() / length  # Eq. 8
    # Budget by score; ties: higher cumulative probability, then lower id.
    scores = [0.0] + score.tolist()
    order = sorted(range(1, n + 1), key=lambda i: (-scores[i], -cum[i], i))
    keep = [False] * (n + 1)
    keep[0] = True
    for i in order[:budget]:
        keep[i] = True
    # Re-add the omitted ancestors (ids descend, so a re-added parent's own parent is handled later).
    for i in range(n, 0, -1):
        if keep[i]:
            keep[par[i]] = True
    count = sum(keep) - 1
    if count <= budget:
        return torch.tensor([i for i in range(n + 1) if keep[i]], device=device)
    children = [0] * (n + 1)
    for i in range(1, n + 1):
        if keep[i]:
            children[par[i]] += 1

    def drop(i: int) -> None:
        keep[i] = False
        children[par[i]] -= 1

    # 1. Leaves shallower than the deepest layer, from shallow to deep (one pass over the repaired tree's leaves).
    deepest = max(dep[i] for i in range(1, n + 1) if keep[i])
    shallow_leaves = [i for i in range(1, n + 1) if keep[i] and children[i] == 0 and dep[i] < deepest]
    for i in sorted(shallow_leaves, key=lambda i: (dep[i], cum[i], -i)):
        if count <= budget:
            break
        drop(i)
        count -= 1
    # 2. Then the lowest-probability nodes, always a leaf so the tree stays closed (ties: deeper, higher id).
    heap = [(cum[i], -dep[i], -i) for i in range(1, n + 1) if keep[i] and children[i] == 0]
    heapq.heapify(heap)
    while count > budget:
        i = -heapq.heappop(heap)[2]
        drop(i)
        count -= 1
        parent = par[i]
        if parent > 0 and children[parent] == 0:  # the parent became a leaf
            heapq.heappush(heap, (cum[parent], -dep[parent], -parent))
    return torch.tensor([i for i in range(n + 1) if keep[i]], device=device)


@dataclass(frozen=True)
class WETAPConfig(PolicyConfig):
    """WETAP hyper-parameters; defaults from Appendix B.4 and the sensitivity studies of section 4.4.

    Args:
        budget: ``B``, most draft nodes verified per step (64).
        length: ``L``, layers of the tree (8).
        w_min, w_max: the width range ``W`` (16, 128).
        gamma: the continuous coefficient of Eq. 5 (1.2).
        alpha: weight of probability vs length in the pruning score, Eq. 8 (0.6).
        top_k, top_p: per-parent candidate filtering (10, 0.9).
        eps: Eq. 7's constant (1e-6).
        acceptance: ``"greedy"`` (lossless, default) or ``"wetap_beam"`` (Eq. 9, lossy, warns).
        tau: the beam-acceptance threshold (0.5; only used with ``"wetap_beam"``).
    """

    budget_field = "budget"
    depth_field = "length"

    budget: int = 64
    length: int = 8
    w_min: int = 16
    w_max: int = 128
    gamma: float = 1.2
    alpha: float = 0.6
    top_k: int = 10
    top_p: float = 0.9
    eps: float = 1e-6
    acceptance: str = "greedy"
    tau: float = 0.5

    def __post_init__(self) -> None:
        check_positive_int(self, "budget")
        check_positive_int(self, "length")
        check_positive_int(self, "w_min")
        check(is_int(self.w_max) and self.w_max >= self.w_min, self, "w_max", self.w_max,
              f"an integer >= w_min ({self.w_min})")  # fmt: skip
        check(self.gamma > 0, self, "gamma", self.gamma, "a number > 0")
        check(0.0 <= self.alpha <= 1.0, self, "alpha", self.alpha, "a number in [0, 1]")
        check_positive_int(self, "top_k")
        check(0.0 < self.top_p <= 1.0, self, "top_p", self.top_p, "a number in (0, 1]")
        check(self.eps > 0, self, "eps", self.eps, "a number > 0")
        check(self.acceptance in ACCEPTANCE_RULES, self, "acceptance", self.acceptance,
              f"one of {', '.join(ACCEPTANCE_RULES)}")  # fmt: skip
        check(0.0 < self.tau <= 1.0, self, "tau", self.tau, "a number in (0, 1]")

    def next_width(self, h_norm: float) -> int:
        """Eq. 5, rounded half-up."""
        return _round_half_up(self.w_min + (self.w_max - self.w_min) * h_norm**self.gamma)


@register_policy("wetap")
class WETAPPolicy(TreePolicy):
    config_class = WETAPConfig

    def __init__(self, config: WETAPConfig | None = None, fixed: Collection[str] | None = None) -> None:
        super().__init__(config, fixed)
        if self.config.acceptance == "wetap_beam":
            warnings.warn(
                f"wetap: acceptance='wetap_beam' (tau={self.config.tau}) accepts beams by the target/draft "
                "probability ratio (WETAP Eq. 9); the output is no longer the target's greedy output "
                "(stats.lossless will be False)",
                UserWarning,
                stacklevel=user_stacklevel(),  # the user's get_policy(...) or from_pretrained(...) line
            )

    @property
    def lossless(self) -> bool:
        return self.config.acceptance == "greedy"

    def reset(self) -> None:
        self._last: dict[str, Any] = {}

    def accept(
        self, tree: TokenTree, target_logits: torch.Tensor, sampler: Sampler | None = None
    ) -> Acceptance:
        """The engine's lossless rule, or with ``acceptance="wetap_beam"`` :func:`~vlmspec.verify.beam_accept`
        (when sampling, its next token is drawn from the target's warped distribution at the chosen node, as
        Algorithm 1's ``t ~ p'``)."""
        if self.config.acceptance != "wetap_beam":
            return super().accept(tree, target_logits, sampler)
        acc = beam_accept(tree, target_logits, self.config.tau)
        if sampler is not None:
            acc = replace(acc, next_token=sampler.sample(target_logits[acc.last]))
        return acc

    def build_tree(self, draft: DraftTree) -> TokenTree:
        c = self.config
        frontier = torch.zeros(1, dtype=torch.long, device=draft.tokens.device)  # the root
        probs = draft.next_probs(frontier)  # [1, V]
        width = c.w_min  # Algorithm 1 line 7
        widths: list[int] = []
        for layer in range(1, c.length + 1):
            top_p, top_tok, ok = filter_top_k_top_p(probs, c.top_k, c.top_p)  # [F, k]
            # [F, k] cumulative probability of each candidate
            cum = draft.cum_probs[frontier][:, None] * top_p
            cum = cum.masked_fill(~ok, -1.0)
            m = min(width, int(ok.sum()))
            if m == 0:
                break
            ids = draft.add_best(frontier, top_tok, top_p, cum, m)  # grouped by parent, parents in order
            if ids.numel() == 0:
                break
            widths.append(ids.numel())
            if layer == c.length:
                break
            width = c.next_width(normalized_entropy(draft.cum_probs[ids]))  # Eq. 3-6
            frontier = ids
            probs = draft.next_probs(frontier)  # one batched draft forward per layer
        candidates = draft.num_nodes
        keep = wetap_prune(draft.parents, draft.depths, draft.cum_probs, c.budget, c.alpha, c.length, c.eps)
        self._last = {"widths": widths, "candidates": candidates}
        return draft.tree(keep)

    def trace(self) -> dict[str, Any]:
        return dict(self._last)
