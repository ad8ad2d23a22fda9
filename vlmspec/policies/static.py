"""``static``: a fixed tree shape (SD-Tree / SpecVLM's static tree).

The shape is a list of paths; a path ``(r1, r2, ..., rd)`` is the node reached by taking the draft's
``r1``-th most likely token at depth 1, then that node's ``r2``-th most likely child, and so on. Every prefix
of a path must itself be a path.

The default is the 63-node tree ``mc_sim_7b_63`` from Medusa (Cai et al., 2024), which EAGLE and SpecVLM use
as their static tree and which SAGE (Appendix A.1) takes as the static baseline's shape: depth 4, up to 10
children of the root.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..draft import DraftTree
from ..tree import TokenTree
from .base import PolicyConfig, TreePolicy, check, rank_paths, register_policy

MC_SIM_7B_63: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip


@dataclass(frozen=True)
class StaticConfig(PolicyConfig):
    """Args:
    paths: the tree shape as rank paths (see module docstring); default: Medusa/EAGLE ``mc_sim_7b_63``.
    """

    budget_field = "paths"
    rank_fields = ("paths",)

    paths: tuple[tuple[int, ...], ...] = MC_SIM_7B_63

    def __post_init__(self) -> None:
        paths = rank_paths(self, "paths")
        object.__setattr__(self, "paths", paths)
        check(len(paths) > 0, self, "paths", self.paths, "at least one path")


@dataclass(frozen=True)
class _Level:
    """Precomputed plan of one depth: where each node's parent sits and which rank it takes."""

    parent_pos: torch.Tensor  # [m] index of the parent among the previous level's nodes (0 = root at depth 1)
    rows: torch.Tensor  # [m] row of the parent in the previous expansion's probabilities
    ranks: torch.Tensor  # [m] rank of the child token among the parent's draft candidates
    expand: torch.Tensor  # [e] indices (within this level) of the nodes that have children
    top: int  # candidates per parent to rank (the largest rank + 1), known on the host

    def to(self, device: torch.device) -> _Level:
        """The level with its index tensors on ``device``."""
        moved = {name: getattr(self, name).to(device) for name in ("parent_pos", "rows", "ranks", "expand")}
        return _Level(**moved, top=self.top)


def plan_levels(paths: tuple[tuple[int, ...], ...]) -> list[_Level]:
    """Turn rank paths into a level-by-level plan with tensor indices (computed once per policy)."""
    ordered = sorted(paths, key=lambda p: (len(p), p))
    levels = [[p for p in ordered if len(p) == d] for d in range(1, max(map(len, ordered)) + 1)]
    plan, prev_level, prev_frontier = [], [()], [()]
    for d, level in enumerate(levels):
        children = levels[d + 1] if d + 1 < len(levels) else []
        frontier = [p for p in level if any(q[:-1] == p for q in children)]
        plan.append(
            _Level(
                parent_pos=torch.tensor([prev_level.index(p[:-1]) for p in level]),
                rows=torch.tensor([prev_frontier.index(p[:-1]) for p in level]),
                ranks=torch.tensor([p[-1] for p in level]),
                expand=torch.tensor([level.index(p) for p in frontier], dtype=torch.long),
                top=max(p[-1] for p in level) + 1,
            )
        )
        prev_level, prev_frontier = level, frontier
    return plan


def grow_planned(draft: DraftTree, plan: list[_Level], root_probs: torch.Tensor) -> None:
    """Grow a planned (static) tree level by level from the root's draft distribution ``[1, V]``."""
    device = root_probs.device
    ids = torch.zeros(1, dtype=torch.long, device=device)  # previous level's node ids (the root)
    probs = root_probs  # [F, V]: distributions of the previous level's nodes that have children
    for level in plan:
        rows, ranks = level.rows.to(device), level.ranks.to(device)
        top_p, top_tok = probs.topk(level.top, dim=-1)  # [F, K]
        ids = draft.add(ids[level.parent_pos.to(device)], top_tok[rows, ranks], top_p[rows, ranks])
        if ids.numel() < rows.numel() or level.expand.numel() == 0:
            break  # depth limit reached, or the leaves' level (leaves are not expanded)
        probs = draft.next_probs(ids[level.expand.to(device)])


@register_policy("static")
class StaticTreePolicy(TreePolicy):
    config_class = StaticConfig

    def reset(self) -> None:
        self._plan = plan_levels(self.config.paths)  # the paths change when fit() sets the node budget

    def build_tree(self, draft: DraftTree) -> TokenTree:
        device = draft.tokens.device
        if (
            self._plan[0].rows.device != device
        ):  # once per request, not a host-to-device copy per level and step
            self._plan = [level.to(device) for level in self._plan]
        root = torch.zeros(1, dtype=torch.long, device=device)
        grow_planned(draft, self._plan, draft.next_probs(root))
        return draft.tree()
