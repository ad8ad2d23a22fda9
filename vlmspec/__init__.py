"""vlmspec: lossless tree speculative decoding for vision-language models."""

from .engine import SpecStats, speculative_generate
from .errors import (
    InputNotFoundError,
    InputTypeError,
    InvalidInputError,
    SlowSpeculationWarning,
    VLMSpecError,
)
from .inputs import VideoClip
from .pipeline import SpecOutput, VLMSpecPipeline
from .policies import TreePolicy, available_policies, get_policy, register_policy
from .prefix_cache import PrefixCache
from .reasoning import ReasoningParser
from .requests import RequestFeed
from .scores import TokenScores
from .streaming import StreamPiece
from .structured import StructuredOutputs
from .tree import TokenTree

__version__ = "0.1.0"

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
