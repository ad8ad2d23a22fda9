"""``chain``: classic speculative decoding (SD-Chain): the draft's greedy chain of ``gamma`` tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..draft import DraftTree
from ..tree import TokenTree
from .base import PolicyConfig, TreePolicy, check, register_policy


@dataclass(frozen=True)
class ChainConfig(PolicyConfig):
    """Args:
    gamma: draft tokens per step (Leviathan et al. use 3-7; 5 is the common default).
    """

    depth_field = "gamma"

    gamma: int = 5

    def __post_init__(self) -> None:
        check(isinstance(self.gamma, int) and self.gamma >= 1, self, "gamma", self.gamma, "an integer >= 1")


@register_policy("chain")
class ChainPolicy(TreePolicy):
    config_class = ChainConfig

    def build_tree(self, draft: DraftTree) -> TokenTree:
        node = torch.zeros(1, dtype=torch.long, device=draft.tokens.device)  # the root
        for _ in range(self.config.gamma):
            probs = draft.next_probs(node)  # [1, V]
            top_p, top_token = probs.max(dim=-1)  # [1], [1]
            node = draft.add(node, top_token, top_p)
            if node.numel() == 0:
                break
        return draft.tree()
