"""Model shapes of the testbed pairs and the families' real config and model classes built from them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import family_builders
from ..family_builders import ModelSpec, generation_config
from .tokenizer import LAYOUTS, check_family

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

__all__ = ["ModelSpec", "build_model", "count_parameters", "generation_config", "model_class"]


def model_class(family: str) -> type[PreTrainedModel]:
    """The family's ``*ForConditionalGeneration`` class."""
    return family_builders.model_class(check_family(family))


def build_config(family: str, spec: ModelSpec, tokenizer: Qwen2Tokenizer) -> Any:
    """Builds the family's real config class for ``spec``.

    Args:
        family: One of :data:`FAMILIES`.
        spec: The model's shape.
        tokenizer: The pair's tokenizer (vocabulary size and special-token ids).

    Returns:
        The family's config (``Qwen2VLConfig``, ``Qwen2_5_VLConfig``, ``LlavaOnevisionConfig``, ``InternVLConfig``,
        ``Qwen3VLConfig``).
    """
    return family_builders.build_config(check_family(family), spec, tokenizer, LAYOUTS[family])


def build_model(family: str, spec: ModelSpec, tokenizer: Qwen2Tokenizer) -> PreTrainedModel:
    """A freshly initialised model of ``spec`` (draws from torch's global RNG; seed it first)."""
    model = model_class(family)(build_config(family, spec, tokenizer))
    model.generation_config = generation_config(tokenizer)
    return model


def count_parameters(model: PreTrainedModel) -> dict[str, int]:
    """Parameter counts: ``total``, ``vision`` (tower + projector/merger) and ``language`` (the rest)."""
    total = sum(p.numel() for p in model.parameters())
    vision = sum(
        p.numel() for n, p in model.named_parameters() if "visual" in n or "vision" in n or "projector" in n
    )
    return {"total": total, "vision": vision, "language": total - vision}
