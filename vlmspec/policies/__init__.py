"""Tree policies, registered by name. ``get_policy("static")``, ``available_policies()``."""

from .ar import ARConfig, ARPolicy
from .base import (
    PolicyConfig,
    StepFeedback,
    TreePolicy,
    available_policies,
    get_policy,
    policy_class,
    register_policy,
)
from .chain import ChainConfig, ChainPolicy
from .sage import SAGEConfig, SAGEPolicy, confidence
from .static import MC_SIM_7B_63, StaticConfig, StaticTreePolicy

__all__ = [
    "ARConfig",
    "ARPolicy",
    "ChainConfig",
    "ChainPolicy",
    "MC_SIM_7B_63",
    "PolicyConfig",
    "SAGEConfig",
    "SAGEPolicy",
    "StaticConfig",
    "StaticTreePolicy",
    "StepFeedback",
    "TreePolicy",
    "available_policies",
    "confidence",
    "get_policy",
    "policy_class",
    "register_policy",
]
