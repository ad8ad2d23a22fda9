"""``pct``: Pruned Candidate Tree (``shared/papers/edd_pct.txt`` section 3.2, Fig. 4).

Expanding draft token ``d_j`` costs one draft forward ``s_d`` and saves a target forward ``s_t`` only if ``d_j`` is
accepted; its expected time gain is ``s_d - p_j * s_t`` (Eq. 5), so a node is worth expanding only when its
acceptance probability ``p_j`` is at least ``s_d / s_t``. The draft's confidence is well calibrated, so
``p_j ~ prod_{i <= j} c_i``: the *cumulative confidence*, the product of the draft probabilities along the path.

Construction (Implementation Details of 3.2):

1. Layer ``l``: every expandable node of layer ``l - 1`` proposes its top-``width`` children (the root is always
   expandable); all of a layer's expandable nodes go through one batched draft forward.
2. A node is expandable iff its cumulative confidence is ``>= s_d / s_t`` (nodes below are marked and never
   generate children).
3. Construction stops when a layer has no expandable node or at ``max_depth``.
4. Leaves whose cumulative confidence is below ``leaf_threshold`` are removed.

Defaults (section 4.1): expansion width 5, maximum depth 10, leaf threshold 0.01. ``s_d / s_t`` is the measured
ratio of a draft forward's time to a target forward's time (the paper: 1.1 ms / 29.8 ms for 7B, 1.4 / 50.1 for
13B on an A6000): :func:`vlmspec.probe.measure_cost_ratio` times the actual pair on the actual device.

**The right ratio depends on the hardware.** On a GPU a decoding forward is memory-bound and costs roughly in
proportion to the weights read, so a small draft is cheap (ratios of a few percent, deep trees). On a CPU, or
with a draft of nearly the target's size (like the tiny test fixtures, whose draft has half the target's layers),
the ratio is much larger (0.55-0.85 for the tiny fixture pairs on one CPU thread, and noisy on a loaded machine),
so few nodes are expanded and the trees are shallow. Measure on the device you decode on; do not reuse a GPU
ratio on a CPU or vice versa.

Choices where the paper is open (and why):

* "Expandable" uses ``>=`` (Fig. 4 marks nodes "less than ``s_d/s_t``" as non-expandable); a ratio above 1
  expands nothing, not even the root (drafting can never pay off), and the step verifies the root alone.
* Leaf removal is repeated until no leaf is below the threshold (a parent left childless below the threshold is
  itself such a leaf). Cumulative confidence never grows along a path, so this keeps exactly the nodes with
  cumulative confidence ``>= leaf_threshold``, which is always an ancestor-closed tree.
* ``cost_ratio=None`` means "measure": a pipeline gives the policy its measured forward costs when it is attached
  (:meth:`PCTPolicy.fit`, the one cost probe of :mod:`vlmspec.probe`, also behind every policy's node budget).
  If a tree is built before any value is known, the paper's 7B ratio (1.1 / 29.8) is used with a warning.
* ``max_nodes`` (not in the paper; ``None`` = no cap) is the node budget, which a pipeline sets from the machine's
  costs unless you do (:mod:`vlmspec.costs`), and ``max_depth`` the depth. The cap matters for tiny ratios: at most
  ``1 / ratio`` nodes of a level can be expandable (their cumulative confidences sum to at most one), so a level
  holds at most ``width / ratio`` candidates; with a cap, a level keeps its most confident candidates.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from ..costs import DEFAULT_BUDGET_FACTOR, ForwardCosts
from ..draft import DraftTree
from ..tree import TokenTree
from .base import PolicyConfig, TreePolicy, check, check_positive_int, is_int, register_policy

PAPER_COST_RATIO = 1.1 / 29.8  # LLaMA2-Chat 7B with EDD on an RTX A6000 (section 4.1)


@dataclass(frozen=True)
class PCTConfig(PolicyConfig):
    """PCT hyper-parameters; defaults from section 4.1.

    Args:
        cost_ratio: ``s_d / s_t``; ``None`` = measured for the actual pair and device (see the module docstring).
        leaf_threshold: leaves with cumulative confidence below this are removed (0.01).
        width: children proposed per expandable node (5).
        max_depth: most layers below the root (10).
        max_nodes: optional cap on draft nodes (``None``: no cap, as in the paper).
    """

    budget_field = "max_nodes"
    depth_field = "max_depth"

    cost_ratio: float | None = None
    leaf_threshold: float = 0.01
    width: int = 5
    max_depth: int = 10
    max_nodes: int | None = None

    def __post_init__(self) -> None:
        if self.cost_ratio is not None:
            check(isinstance(self.cost_ratio, (int, float)) and not isinstance(self.cost_ratio, bool)
                  and self.cost_ratio > 0, self, "cost_ratio", self.cost_ratio,
                  "a number > 0 (s_d / s_t), or None to measure it")  # fmt: skip
        check(
            0.0 <= self.leaf_threshold < 1.0,
            self,
            "leaf_threshold",
            self.leaf_threshold,
            "a number in [0, 1)",
        )
        check_positive_int(self, "width")
        check_positive_int(self, "max_depth")
        if self.max_nodes is not None:
            check(is_int(self.max_nodes) and self.max_nodes >= 1, self, "max_nodes", self.max_nodes,
                  "an integer >= 1, or None for no cap")  # fmt: skip


@register_policy("pct")
class PCTPolicy(TreePolicy):
    config_class = PCTConfig

    def __init__(self, config: PCTConfig | None = None, fixed: Collection[str] | None = None) -> None:
        super().__init__(config, fixed)
        self._warned = False

    # ---- the cost ratio --------------------------------------------------------------------------------------
    @property
    def cost_ratio(self) -> float | None:
        """``s_d / s_t`` in use: the configured or measured value, ``None`` while unknown."""
        return self.config.cost_ratio

    def free_hardware_options(self) -> tuple[str, ...]:
        """The base's, plus ``cost_ratio`` while it is unknown or was not set by the user."""
        free = super().free_hardware_options()
        if self.config.cost_ratio is None or "cost_ratio" not in self.fixed:
            free = (*free, "cost_ratio")
        return free

    def fit(self, costs: ForwardCosts, factor: float = DEFAULT_BUDGET_FACTOR, rows: int = 1) -> None:
        """The base's hardware budgets, and ``s_d / s_t`` from ``costs`` unless the user configured one (with
        ``rows`` requests per forward: one forward of each model for all of them)."""
        super().fit(costs, factor, rows)
        if "cost_ratio" in self.free_hardware_options():
            ratio = costs.draft_cost(rows) / costs.target_cost(rows)
            self.config = dataclasses.replace(self.config, cost_ratio=ratio)

    # ---- tree ------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._last: dict[str, Any] = {}

    def _ratio_in_use(self) -> float:
        if self.config.cost_ratio is not None:
            return self.config.cost_ratio
        if not self._warned:
            warnings.warn(
                "pct: no cost ratio s_d/s_t was measured or configured; using the paper's 7B GPU ratio "
                f"{PAPER_COST_RATIO:.4f}. Attach the policy to a pipeline (it measures the pair on its device), "
                "or pass cost_ratio=vlmspec.probe.measure_cost_ratio(target, draft)",
                UserWarning,
                stacklevel=3,
            )
            self._warned = True
        return PAPER_COST_RATIO

    def build_tree(self, draft: DraftTree) -> TokenTree:
        c = self.config
        ratio = self._ratio_in_use()
        device = draft.tokens.device
        depth = 0
        if ratio <= 1.0:  # the root's cumulative confidence is 1
            frontier = torch.zeros(1, dtype=torch.long, device=device)
            probs = draft.next_probs(frontier)  # [1, V]
            for level in range(1, c.max_depth + 1):
                k = min(c.width, probs.shape[-1])
                top_p, top_tok = probs.topk(k, dim=-1)  # [F, k]
                parents = frontier[:, None].expand(-1, k).reshape(-1)
                top_tok, top_p = top_tok.reshape(-1), top_p.reshape(-1)
                if c.max_nodes is not None:
                    room = c.max_nodes - draft.num_nodes
                    if room <= 0:
                        break
                    if parents.numel() > room:  # the level's most confident candidates
                        best = (draft.cum_probs[parents] * top_p).topk(room).indices.sort().values
                        parents, top_tok, top_p = parents[best], top_tok[best], top_p[best]
                ids = draft.add(parents, top_tok, top_p)
                if ids.numel() == 0:
                    break
                depth = level
                if level == c.max_depth:
                    break
                frontier = ids[draft.cum_probs[ids] >= ratio]  # expandable: cumulative confidence >= s_d/s_t
                if frontier.numel() == 0:
                    break
                probs = draft.next_probs(frontier)  # one batched draft forward per layer
        keep = draft.cum_probs >= c.leaf_threshold  # iterated leaf removal (module docstring)
        keep[0] = True
        self._last = {"cost_ratio": ratio, "depth": depth, "candidates": draft.num_nodes}
        return draft.tree(keep.nonzero().flatten())

    def trace(self) -> dict[str, Any]:
        return dict(self._last)
