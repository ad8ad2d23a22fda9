"""Tree policies, registered by name. ``get_policy("static")``, ``available_policies()``."""

from .ar import ARConfig, ARPolicy
from .base import (
    PolicyConfig,
    StepFeedback,
    TreePolicy,
    available_policies,
    check_greedy,
    get_policy,
    policy_class,
    policy_with,
    register_policy,
)
from .c2t import C2TClassifier, C2TConfig, C2TPolicy, distribution_entropy
from .chain import ChainConfig, ChainPolicy
from .eagle2 import EAGLE2Config, EAGLE2Policy
from .pct import PCTConfig, PCTPolicy
from .sage import SAGEConfig, SAGEPaperConfig, SAGEPaperPolicy, SAGEPolicy, confidence
from .static import MC_SIM_7B_63, StaticConfig, StaticTreePolicy
from .wetap import WETAPConfig, WETAPPolicy, wetap_prune

__all__ = [
    "ARConfig",
    "ARPolicy",
    "C2TClassifier",
    "C2TConfig",
    "C2TPolicy",
    "ChainConfig",
    "ChainPolicy",
    "EAGLE2Config",
    "EAGLE2Policy",
    "MC_SIM_7B_63",
    "PCTConfig",
    "PCTPolicy",
    "PolicyConfig",
    "SAGEConfig",
    "SAGEPaperConfig",
    "SAGEPaperPolicy",
    "SAGEPolicy",
    "StaticConfig",
    "StaticTreePolicy",
    "StepFeedback",
    "TreePolicy",
    "WETAPConfig",
    "WETAPPolicy",
    "available_policies",
    "check_greedy",
    "confidence",
    "distribution_entropy",
    "get_policy",
    "policy_with",
    "policy_class",
    "register_policy",
    "wetap_prune",
]

from .dsbd import DSBDConfig, DSBDPolicy

__all__ += ["DSBDConfig", "DSBDPolicy"]
