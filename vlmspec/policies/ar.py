"""``ar``: plain autoregressive decoding with the target, the speed baseline (must equal ``generate()``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..draft import DraftTree
from ..tree import TokenTree
from .base import PolicyConfig, TreePolicy, register_policy


@dataclass(frozen=True)
class ARConfig(PolicyConfig):
    """No options: every step verifies only the root and emits the target's next token."""


@register_policy("ar")
class ARPolicy(TreePolicy):
    config_class = ARConfig
    uses_draft = False

    def build_tree(self, draft: DraftTree) -> TokenTree:
        return draft.tree()
