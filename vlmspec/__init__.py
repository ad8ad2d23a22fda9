"""vlmspec: lossless tree speculative decoding for vision-language models.

The public names are imported on first use (PEP 562), so ``import vlmspec`` and the command line's ``--help`` and
input checks do not wait for torch and transformers; ``from vlmspec import VLMSpecPipeline`` works as always.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    InputNotFoundError,
    InputTypeError,
    InvalidInputError,
    SlowSpeculationWarning,
    VLMSpecError,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .engine import SpecStats, speculative_generate
    from .inputs import VideoClip
    from .pipeline import SpecOutput, VLMSpecPipeline
    from .policies import TreePolicy, available_policies, get_policy, register_policy
    from .prefix_cache import PrefixCache
    from .reasoning import ReasoningParser
    from .requests import RequestFeed
    from .scores import TokenScores
    from .streaming import StreamPiece
    from .structured_outputs import StructuredOutputs
    from .tree import TokenTree

__version__ = "0.1.0"

_LAZY = {
    "SpecStats": "engine",
    "speculative_generate": "engine",
    "VideoClip": "inputs",
    "SpecOutput": "pipeline",
    "VLMSpecPipeline": "pipeline",
    "TreePolicy": "policies",
    "available_policies": "policies",
    "get_policy": "policies",
    "register_policy": "policies",
    "PrefixCache": "prefix_cache",
    "ReasoningParser": "reasoning",
    "RequestFeed": "requests",
    "TokenScores": "scores",
    "StreamPiece": "streaming",
    "StructuredOutputs": "structured_outputs",
    "TokenTree": "tree",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vlmspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "InputNotFoundError",
    "InputTypeError",
    "InvalidInputError",
    "PrefixCache",
    "ReasoningParser",
    "RequestFeed",
    "SlowSpeculationWarning",
    "SpecOutput",
    "SpecStats",
    "StreamPiece",
    "StructuredOutputs",
    "TokenScores",
    "TokenTree",
    "TreePolicy",
    "VideoClip",
    "VLMSpecError",
    "VLMSpecPipeline",
    "__version__",
    "available_policies",
    "get_policy",
    "register_policy",
    "speculative_generate",
]
