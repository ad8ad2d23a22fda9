"""``sage``: entropy-guided adaptive trees (SAGE, ``shared/papers/sage.txt``), the default policy.

Per step (Algorithm 1):

1. Confidence from the draft's top-k entropy (Eq. 7-9)::

       P~_i = P_i / sum_{j in top-k} P_j          H = -sum_i P~_i log P~_i          alpha = 1 - H / log k

2. Depth and width (Eq. 10-11), with ``D_max`` the history-adjusted maximum depth::

       D(alpha) = D_min + alpha * (D_max - D_min)       W(alpha) = W_min + (1 - alpha) * (W_max - W_min)

3. Level ``l`` of the tree: each node keeps its top-``W_l`` draft candidates (Eq. 12)::

       W_1 = W(alpha)          W_l = W(alpha) * (1 / l) * (0.5 + P_parent)   for l >= 2

   and a candidate is kept only if its cumulative probability exceeds ``theta_l = 0.1 * l / D(alpha)``.
   Growth stops at depth ``D(alpha)`` or at ``N_max`` nodes.

4. Lookahead: the confidence measured while drafting step ``t`` shapes the tree of step ``t + 1``
   (the draft's distributions are already there; no extra forward).

5. Adaptive history tracking: a sliding window of recent acceptance lengths lowers ``D_max`` when its mean
   is below the lower threshold, raises it when above the upper threshold, and leaves it between them.

Choices where the paper is open (and why):

* ``P_out`` for the confidence is the draft's distribution at the *root* of the step (the draft's prediction of
  the step's first new token): Eq. 7 speaks of one logit vector ``o_t`` per decoding step, and the root's is the
  one every step has.
* ``D(alpha)`` and ``W(alpha)`` are rounded half-up to integers; ``W_l`` (``l >= 2``) is rounded *up*
  (ceil). Rounding ``W_l`` down would give ``W_l = 0`` from ``l = 6`` on even for a fully confident draft
  (``W = 2``), capping depth far below ``D(alpha) = 8`` and contradicting Eq. 10; with ceil the threshold
  ``theta_l`` is what ends a deep branch, as the paper's formal definition of ``T_alpha`` reads.
* ``P_parent`` is the parent's own draft probability (given its parent); the cumulative probability is the
  separate quantity that ``theta_l`` tests.
* When a level would exceed ``N_max``, its candidates with the highest cumulative probability are kept.
* History: the acceptance length is tau (accepted draft tokens, bonus excluded: Eq. 5's count). ``D_max``
  starts at ``d_max`` and moves by one within ``[d_min, d_max]``; a decision is taken each time the window is
  full, and the window is then cleared, so one bad stretch moves the depth once rather than every step.
* The first step can use the static initial tree of Appendix A.1 (``initial_paths``; ``sage_paper`` uses the
  Medusa/EAGLE 63-node tree) with alpha = 0.5 as Algorithm 1 initialises it; ``initial_paths=()`` (the ``sage``
  default) builds the first tree from alpha = 0.5 like any other.

Beyond the paper (an option, measured): ``confidence="root"`` shapes each tree from *this* step's root confidence
instead of the previous step's (``"lookahead"``, the paper's Algorithm 1 and the default). The root's draft
distribution is computed before any level is grown, so it costs no extra forward. Why try it: on the calibrated
pair a step advances 3.6-5.3 tokens, past the entropy's memory (token-lag autocorrelation 0.52 at lag 1, 0.14 at
lag 2), and the previous step's alpha correlates 0.10 with this step's accepted length where this step's root
alpha correlates 0.57 (``docs/sage_study.md``). Why it is not the default: it raises tau (3.83 vs 3.44 on six
captions) but grows deeper trees on confident roots and wider ones on the others, whose verification costs more
than the extra tokens repay on the CPU (2.13-2.66x vs 2.41-2.72x over ``generate()`` in three sweeps,
``docs/sage.md``).

Beyond the paper, and ``sage``'s default: ``growth="cost"`` shapes each tree node by node from what a node is
worth on this machine, where Eq. 10-12 shape it level by level from one alpha per step. A candidate (one of a
node's top-k draft tokens) is verified when its cumulative draft probability, the draft's estimate that the target
accepts it, repays what it adds to the step::

    keep c  iff  cum(c) > (V / T) * node_cost
    V = 1 + sum(cum) of the nodes kept          T = 1 + N * node_cost + L * level_cost

``V`` is the step's expected tokens before the level and ``T`` its cost so far in plain decoding steps (``N``
nodes, ``L`` draft forwards, this level's included), so ``V / T`` is the rate an extra node has to beat (fixed for
a level's candidates, so siblings do not raise each other's bar). A level keeps at most half the node budget left,
so that where nodes are nearly free the first levels leave room for the deeper ones. The draft runs another level
only when that level's expected tokens, each new node's own probability standing for its best child's (the
entropy's lag-1 memory), repay a draft forward, ``sum(cum * p) > (V / T) * level_cost``, and its best node is
likely to clear the node rule, ``max(cum * p) > (V / T) * node_cost``. So a node gets as many children as its own
distribution supports (a peaked one: one; a flat one: several) and a branch ends where its own confidence runs
out: SAGE's entropy-guided width and depth, per node instead of per step. ``node_cost`` and ``level_cost`` come
from the pipeline's cost probe (:meth:`~vlmspec.costs.ForwardCosts.tree_costs`): where verification is nearly
free (a GPU) the same rule keeps more of the budget; on a CPU it keeps the few nodes likely to be accepted.
``N_max`` bounds the nodes; a pipeline fits ``D_max`` to the node budget, so the level rule sets the depth and
``D_max`` (which Step 5's history still moves, one level per window) is a safety cap; alpha, the widths and
``theta_l`` are not used. Why: on the calibrated pairs the paper's step-wide shape spends its nodes and draft
forwards where acceptance is unlikely (the previous step's alpha barely predicts this step's, and Eq. 12 gives
every node of a level the same width); growing by cost accepts more tokens with fewer draft forwards at about the
same node count (``docs/sage.md`` has the figures and commands). ``growth="paper"`` keeps Algorithm 1 as written.

Two registered names: ``sage`` (the default policy: SAGE's budgets, grown by cost, :class:`SAGEConfig`)
and ``sage_paper`` (the paper's algorithm with its literal settings, :class:`SAGEPaperConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..costs import DEFAULT_BUDGET_FACTOR, ForwardCosts
from ..draft import DraftTree
from ..tree import TokenTree
from .base import (
    PolicyConfig,
    StepFeedback,
    TreePolicy,
    check,
    is_int,
    rank_paths,
    register_policy,
    truncate_paths,
)
from .static import MC_SIM_7B_63, grow_planned, plan_levels

CONFIDENCE_SOURCES: tuple[str, ...] = ("lookahead", "root")
GROWTH_RULES: tuple[str, ...] = ("cost", "paper")
COST_FIELDS: tuple[str, ...] = ("node_cost", "level_cost")
"""The options :meth:`SAGEPolicy.fit` measures for ``growth="cost"`` (:meth:`ForwardCosts.tree_costs`)."""


def confidence(probs: torch.Tensor, k: int) -> torch.Tensor:
    """SAGE confidence (Eq. 7-9) of next-token distributions.

    Args:
        probs: ``[..., V]`` probabilities.
        k: top-k size.

    Returns:
        ``[...]`` alpha in ``[0, 1]``: 0 for a uniform top-k, 1 for a one-hot distribution. A ``k`` above the
        vocabulary is taken as the vocabulary. A distribution holding NaN (a broken draft) has confidence 0.
    """
    k = min(k, probs.shape[-1])
    top = probs.topk(k, dim=-1).values  # [..., k]
    top = top / top.sum(dim=-1, keepdim=True).clamp_min(1e-30)  # Eq. 7
    entropy = -(top * top.clamp_min(1e-30).log()).sum(dim=-1)  # Eq. 8
    alpha = (1.0 - entropy / math.log(k)).clamp(0.0, 1.0)  # Eq. 9
    # NaN (a draft whose weights or activations hold NaN or overflow, e.g. a damaged checkpoint or fp16 overflow)
    # counts as no confidence, not as an error: the draft only proposes and the target's verification keeps the
    # output lossless whatever it proposes, as every other policy does with such a draft (they decode through it,
    # slower); refusing here would end a generation that is still correct. Confidence 0 is what a distribution
    # that says nothing deserves: the shallowest tree (D(0) = d_min), and no NaN reaches Eq. 10-11's rounding.
    return torch.nan_to_num(alpha, nan=0.0)


def _add_kept(
    draft: DraftTree,
    frontier: torch.Tensor,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    kept: np.ndarray,
    cum: np.ndarray,
    budget: int,
) -> tuple[torch.Tensor, np.ndarray]:
    """Add the candidates a rule keeps, the ``budget`` most probable of them when there are more (``N_max``).

    Args:
        draft: the tree being grown.
        frontier: ``[F]`` node ids; candidate ``(i, j)`` (flat index ``i * k + j``) is child ``tokens[i, j]`` of
            ``frontier[i]``.
        tokens, probs: ``[F, k]`` candidate tokens and their draft probabilities given their parents.
        kept: ``[n]`` ascending flat indices of the candidates the rule keeps (on the host).
        cum: ``[F * k]`` the candidates' cumulative probabilities (on the host; the level's one read).
        budget: the most nodes to add (``<= 0``: none).

    Returns:
        The added node ids ``[m]`` and their flat indices ``[m]`` (on the host).
    """
    if kept.size > max(budget, 0):  # N_max: the most probable candidates of this level, still ascending
        kept = np.sort(kept[np.argsort(-cum[kept], kind="stable")[: max(budget, 0)]])
    if kept.size == 0:
        return frontier[:0], kept
    return draft.add_candidates(frontier, tokens, probs, torch.from_numpy(kept).to(frontier.device)), kept


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


@dataclass(frozen=True)
class SAGEConfig(PolicyConfig):
    """SAGE hyper-parameters: vlmspec's measured defaults; :class:`SAGEPaperConfig` holds the paper's (section 5.1).

    By default the tree grows by cost (``growth="cost"``, module docstring); with ``growth="paper"`` the mechanics
    are the paper's (Eq. 7-12, lookahead, history) and the ranges they move in are fitted to what a verification
    costs. The paper's ranges (depth 3-8, width 2-10, 64 nodes, a 63-node static first tree) assume a
    GPU, where verifying 64 tokens costs about one. On the calibrated CPU pair c_t(33)/c_t(1) = 2.7 and
    c_t(64)/c_t(1) = 4.0, so wide trees cost more than their extra accepted tokens repay, while the draft's
    confident runs reward depth; a lower cumulative-probability threshold (``theta_scale`` 0.05) lets the deeper
    trees keep their likely branches. The measurements (``python -m vlmspec_eval.sage_sweep`` and the bench) are in
    ``docs/sage.md``.

    Args:
        d_min, d_max: depth range (6, 10; paper 3, 8). ``d_min`` 6: with an accurate draft the shallow trees
            lose accepted tokens (tau 3.62 -> 3.84 and 3.47 -> 3.72 at the same nodes per step, ``docs/sage.md``).
        w_min, w_max: width range (2, 6; paper 2, 10).
        top_k: k of the top-k entropy (10); with ``growth="cost"``, the most children a node may get.
        n_max: most draft nodes per tree (32; paper 64).
        theta_scale: the factor in ``theta_l = theta_scale * l / D(alpha)`` (0.05; paper 0.1).
        init_alpha: alpha before any measurement (0.5, Algorithm 1).
        window: acceptance-history window (10).
        lower, upper: history thresholds on the mean acceptance length (2, 3).
        initial_paths: the first step's static tree (Appendix A.1; ``()``, the default here, builds it from
            ``init_alpha`` like every later step; the paper uses the 63-node Medusa/EAGLE tree).
        confidence: whose alpha shapes a step's tree: ``"lookahead"`` (the previous step's root, the paper's
            Algorithm 1; default) or ``"root"`` (this step's root); see the module docstring.
        growth: ``"cost"`` (default: each node kept for what it is worth on this machine) or ``"paper"`` (Eq.
            10-12 at the step's alpha); ``d_min``, ``w_min``, ``w_max``, ``theta_scale``, ``init_alpha`` and
            ``confidence`` shape ``"paper"`` trees only (``d_min`` also bounds the history's ``D_max``).
        node_cost, level_cost: for ``growth="cost"``, one more verified node and one more draft forward in plain
            decoding steps; a pipeline measures them (:meth:`~vlmspec.costs.ForwardCosts.tree_costs`) unless set.
            The defaults (0.02, 0.05) are the calibrated CPU pair's, for a policy used without a pipeline.
    """

    budget_field = "n_max"
    depth_field = "d_max"
    rank_fields = ("initial_paths",)

    d_min: int = 6
    d_max: int = 10
    w_min: int = 2
    w_max: int = 6
    top_k: int = 10
    n_max: int = 32
    theta_scale: float = 0.05
    init_alpha: float = 0.5
    window: int = 10
    lower: float = 2.0
    upper: float = 3.0
    initial_paths: tuple[tuple[int, ...], ...] = ()
    confidence: str = "lookahead"
    growth: str = "cost"
    node_cost: float = 0.02
    level_cost: float = 0.05

    def __post_init__(self) -> None:
        object.__setattr__(self, "initial_paths", rank_paths(self, "initial_paths"))
        check(self.d_min >= 1, self, "d_min", self.d_min, "an integer >= 1")
        check(self.d_max >= self.d_min, self, "d_max", self.d_max, f"an integer >= d_min ({self.d_min})")
        check(self.w_min >= 1, self, "w_min", self.w_min, "an integer >= 1")
        check(self.w_max >= self.w_min, self, "w_max", self.w_max, f"an integer >= w_min ({self.w_min})")
        check(self.top_k >= 2, self, "top_k", self.top_k, "an integer >= 2 (entropy is normalised by log k)")
        if self.growth == "paper":
            check(self.top_k >= self.w_max, self, "top_k", self.top_k, f"at least w_max ({self.w_max})")
        check(self.n_max >= 1, self, "n_max", self.n_max, "an integer >= 1")
        check(self.theta_scale >= 0, self, "theta_scale", self.theta_scale, "a number >= 0")
        check(0.0 <= self.init_alpha <= 1.0, self, "init_alpha", self.init_alpha, "a number in [0, 1]")
        check(self.window >= 1, self, "window", self.window, "an integer >= 1")
        check(self.lower <= self.upper, self, "lower", self.lower, f"a number <= upper ({self.upper})")
        check(self.confidence in CONFIDENCE_SOURCES, self, "confidence", self.confidence,
              f"one of {', '.join(CONFIDENCE_SOURCES)}")  # fmt: skip
        check(self.growth in GROWTH_RULES, self, "growth", self.growth, f"one of {', '.join(GROWTH_RULES)}")
        for field in COST_FIELDS:
            check(getattr(self, field) >= 0, self, field, getattr(self, field), "a number >= 0")
        if self.initial_paths:
            check(len(self.initial_paths) <= self.n_max, self, "initial_paths", len(self.initial_paths),
                  f"at most n_max ({self.n_max}) paths")  # fmt: skip

    @classmethod
    def implied_options(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The base's, and the converse: a ``d_min`` set above the default ``d_max`` raises it (when the depth is
        the machine's to fit), ``initial_paths`` set beyond the default ``n_max`` raise it to their count."""
        implied, defaults = super().implied_options(values), cls()
        d_min, paths = values.get("d_min"), values.get("initial_paths")
        if cls.depth_field == "d_max" and "d_max" not in values and is_int(d_min) and d_min > defaults.d_max:
            implied["d_max"] = d_min
        if "n_max" not in values and isinstance(paths, (list, tuple)) and len(paths) > defaults.n_max:
            implied["n_max"] = len(paths)
        return implied

    def budget_options(
        self, nodes: int | None = None, depth: int | None = None, fixed: Collection[str] = ()
    ) -> dict[str, Any]:
        """The base's options, kept consistent: ``d_min`` lowered to a smaller ``d_max`` and ``initial_paths`` cut to
        ``n_max``, unless they are in ``fixed`` (set by the user): then ``d_max`` is at least ``d_min`` and
        ``n_max`` at least the number of ``initial_paths``."""
        if depth is not None and "d_min" in fixed:
            depth = max(depth, self.d_min)
        if nodes is not None and "initial_paths" in fixed:
            nodes = max(nodes, len(self.initial_paths))
        options = super().budget_options(nodes, depth, fixed)
        if depth is not None and self.depth_field is not None and "d_min" not in fixed:
            options["d_min"] = min(self.d_min, depth)
        if nodes is not None and self.initial_paths and "initial_paths" not in fixed:
            options["initial_paths"] = truncate_paths(self.initial_paths, nodes)
        return options

    def depth(self, alpha: float, d_max: int) -> int:
        """Eq. 10, rounded half-up."""
        return _round_half_up(self.d_min + alpha * (d_max - self.d_min))

    def width(self, alpha: float) -> int:
        """Eq. 11, rounded half-up."""
        return _round_half_up(self.w_min + (1.0 - alpha) * (self.w_max - self.w_min))

    def threshold(self, level: int, depth: int) -> float:
        """theta_l = theta_scale * l / D(alpha) (the paper: 0.1 * l / D(alpha))."""
        return self.theta_scale * level / depth


@register_policy("sage")
class SAGEPolicy(TreePolicy):
    config_class = SAGEConfig

    def reset(self) -> None:
        c = self.config
        self._alpha = c.init_alpha
        self._max_depth = c.d_max
        self._history: deque[int] = deque(maxlen=c.window)
        self._first = True
        self._plan = plan_levels(c.initial_paths) if c.initial_paths else None
        self._last: dict[str, Any] = {}

    # ---- tree ------------------------------------------------------------------------------------------------
    def build_tree(self, draft: DraftTree) -> TokenTree:
        c = self.config
        root = torch.zeros(1, dtype=torch.long, device=draft.tokens.device)
        root_probs = draft.next_probs(root)  # [1, V]
        d_max = self._max_depth
        if c.growth == "cost" and not (self._first and self._plan is not None):
            depth, width = self._grow_by_cost(draft, root_probs, min(d_max, draft.depth_limit))
            self._first = False
            self._last = {"depth": depth, "width": width, "max_depth": d_max}
            return draft.tree()
        root_alpha = float(confidence(root_probs[0], c.top_k))  # host sync (needed: it sets the tree's shape)
        alpha = root_alpha if c.confidence == "root" else self._alpha
        depth, width = c.depth(alpha, d_max), c.width(alpha)
        if self._first and self._plan is not None:
            grow_planned(draft, self._plan, root_probs)
        else:
            self._grow_adaptive(draft, root_probs, depth, width)
        self._first = False
        self._last = {"alpha": alpha, "depth": depth, "width": width, "max_depth": d_max}
        # Lookahead (Algorithm 1, lines 15-17): this step's draft confidence shapes the next tree.
        self._alpha = root_alpha
        return draft.tree()

    def _grow_adaptive(self, draft: DraftTree, probs: torch.Tensor, depth: int, width: int) -> None:
        c = self.config
        frontier = torch.zeros(1, dtype=torch.long, device=probs.device)  # node ids whose `probs` we hold
        for level in range(1, depth + 1):
            budget = c.n_max - draft.num_nodes
            if budget <= 0:
                break
            # Eq. 12: per-parent width (W_1 = W(alpha)); ranks >= W_l are not candidates.
            if level == 1:
                widths = torch.full_like(frontier, width, dtype=torch.float32)
            else:
                widths = (width / level * (0.5 + draft.probs[frontier])).ceil()  # [F]
            k = min(math.ceil(width / level * 1.5), c.top_k, probs.shape[-1])  # >= every W_l (P_parent <= 1)
            top_p, top_tok = probs.topk(k, dim=-1)  # [F, k]
            # [F, k] cumulative probability of each candidate
            cum = draft.cum_probs[frontier][:, None] * top_p
            ranks = torch.arange(k, device=probs.device)[None, :]
            keep = (ranks < widths[:, None]) & (cum > c.threshold(level, depth))  # [F, k]
            # the level's host sync (needed: the kept set depends on the values)
            host_cum, host_keep = torch.stack([cum, keep.float()]).numpy(force=True).reshape(2, -1)
            ids, _ = _add_kept(draft, frontier, top_tok, top_p, np.flatnonzero(host_keep), host_cum, budget)
            if ids.numel() == 0 or level == depth or draft.num_nodes >= c.n_max:
                break
            frontier = ids
            probs = draft.next_probs(frontier)  # one batched draft forward for the whole level

    def _grow_by_cost(self, draft: DraftTree, probs: torch.Tensor, depth: int) -> tuple[int, int]:
        """``growth="cost"``: up to ``depth`` levels, each keeping every candidate whose chance of acceptance repays
        its verification (module docstring). Returns the levels grown and the widest one's node count.

        A level reads its candidates' probabilities on the host once (the kept set and whether the draft runs again
        depend on them) and decides there: no other host sync, and no device op per decision."""
        c = self.config
        grown, widest = 0, 0
        frontier = torch.zeros(1, dtype=torch.long, device=probs.device)  # node ids whose `probs` we hold
        # The step's expected tokens: the bonus token and the kept nodes' cumulative probabilities.
        value = 1.0
        for level in range(1, depth + 1):
            top_p, top_tok = probs.topk(min(c.top_k, probs.shape[-1]), dim=-1)  # [F, k]
            # [F, k] cumulative probability of each candidate
            cum = draft.cum_probs[frontier][:, None] * top_p
            # the level's host sync (needed: the kept set and whether the draft runs again depend on the values)
            host_cum, host_p = torch.stack([cum, top_p]).numpy(force=True).reshape(2, -1)
            cost = 1.0 + draft.num_nodes * c.node_cost + level * c.level_cost  # the step so far, in AR steps
            # Keep cum > (value / cost) * node_cost; at most half the budget left, so that where nodes are nearly free
            # (a flat verification curve) the first levels leave room for the deeper ones the accepted path runs on.
            room = (c.n_max - draft.num_nodes + 1) // 2
            worth = np.flatnonzero(host_cum * cost > value * c.node_cost)
            ids, kept = _add_kept(draft, frontier, top_tok, top_p, worth, host_cum, room)
            if kept.size == 0:
                break
            grown, widest = level, max(widest, kept.size)
            kept_cum, kept_p = host_cum[kept], host_p[kept]
            value += float(kept_cum.sum())
            if level == depth or draft.num_nodes >= c.n_max:
                break
            # Another level pays when its expected tokens, each node's own probability standing for its child's,
            # repay a draft forward, sum(cum * p) > (value / cost) * level_cost, and when its best node is likely
            # to clear the node rule.
            cost = 1.0 + draft.num_nodes * c.node_cost + level * c.level_cost
            expected = kept_cum * kept_p  # [m]
            if not (
                expected.sum() * cost > value * c.level_cost and expected.max() * cost > value * c.node_cost
            ):
                break
            frontier = ids
            probs = draft.next_probs(frontier)  # one batched draft forward for the whole level
        return grown, widest

    # ---- hardware --------------------------------------------------------------------------------------------
    def free_hardware_options(self) -> tuple[str, ...]:
        """The base's, plus the cost of a node and of a level for ``growth="cost"`` unless the user set them."""
        free = super().free_hardware_options()
        if self.config.growth != "cost":
            return free
        return (*free, *(f for f in COST_FIELDS if f not in self.fixed))

    def fitted_depth(self, costs: ForwardCosts, nodes: int, rows: int = 1) -> int:
        """The base's for ``growth="paper"``; the node budget for ``growth="cost"``, whose level rule decides how
        deep each step goes (``D_max`` then only bounds it: a tree is never deeper than its nodes)."""
        return nodes if self.config.growth == "cost" else super().fitted_depth(costs, nodes, rows)

    def expected_speedup(self, costs: ForwardCosts, rows: int = 1) -> float:
        """The base's, with ``growth="cost"`` trees priced at the machine's depth for their node budget (the level
        rule's depth, which follows the draft's confidence, is not known in advance)."""
        c = self.config
        if c.growth != "cost":
            return super().expected_speedup(costs, rows)
        return costs.expected_speedup(
            c.n_max, min(c.d_max, costs.depth_budget(c.n_max, rows=rows)), rows=rows
        )

    def fit(self, costs: ForwardCosts, factor: float = DEFAULT_BUDGET_FACTOR, rows: int = 1) -> None:
        """The base's node budget and depth, and ``node_cost`` / ``level_cost`` from ``costs``
        (:meth:`ForwardCosts.tree_costs` at that budget) where the user left them to the machine."""
        super().fit(costs, factor, rows)
        free = [f for f in COST_FIELDS if f in self.free_hardware_options()]
        if free:
            measured = dict(zip(COST_FIELDS, costs.tree_costs(self.config.n_max, rows), strict=True))
            self.config = dataclasses.replace(self.config, **{f: measured[f] for f in free})
            self.reset()

    # ---- feedback --------------------------------------------------------------------------------------------
    def feedback(self, step: StepFeedback) -> None:
        """Adaptive history tracking: move the maximum depth when the window mean leaves [lower, upper]."""
        c = self.config
        self._history.append(step.accepted)
        if len(self._history) < c.window:
            return
        mean = sum(self._history) / len(self._history)
        if mean < c.lower and self._max_depth > c.d_min:
            self._max_depth -= 1
            self._history.clear()
        elif mean > c.upper and self._max_depth < c.d_max:
            self._max_depth += 1
            self._history.clear()

    def trace(self) -> dict[str, Any]:
        return dict(self._last)


@dataclass(frozen=True)
class SAGEPaperConfig(SAGEConfig):
    """SAGE exactly as the paper sets it (section 5.1, Appendix A.1); ``configs/policies/sage_paper.yaml``."""

    depth_field = None  # the paper's depth range stays literal; only the node budget follows the machine

    d_min: int = 3
    d_max: int = 8
    w_min: int = 2
    w_max: int = 10
    n_max: int = 64
    theta_scale: float = 0.1
    initial_paths: tuple[tuple[int, ...], ...] = MC_SIM_7B_63
    growth: str = "paper"


@register_policy("sage_paper")
class SAGEPaperPolicy(SAGEPolicy):
    """``sage`` with the paper's literal hyper-parameters, benched beside the default."""

    config_class = SAGEPaperConfig
